#include <cstdio>
int main() { std::puts("pagedlm"); return 0; }
