#include "pagedlm/server/chat_page.h"

namespace pagedlm::server {

// ?prompt=...&max_tokens=N sends one message on load (how the browser test drives it); the page
// sets data-state="done" on <body> when a reply has finished streaming.
const char kChatPageHtml[] = R"html(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pagedlm chat</title>
<style>
  body { font-family: sans-serif; max-width: 48rem; margin: 2rem auto; padding: 0 1rem; }
  #log .msg { white-space: pre-wrap; margin: .5rem 0; padding: .5rem; border-radius: .3rem; }
  #log .user { background: #e8f0fe; }
  #log .assistant { background: #f1f3f4; }
  form { display: flex; gap: .5rem; }
  #input { flex: 1; }
  #status { color: #666; font-size: .9em; }
</style>
</head>
<body data-state="idle">
<h1>pagedlm chat</h1>
<div id="log"></div>
<form id="form">
  <input id="input" autocomplete="off" placeholder="Say something">
  <button id="send">Send</button>
</form>
<p>
  <label>API key <input id="key" type="password" size="16"></label>
  <label>max tokens <input id="max" type="number" value="256" min="1" style="width:5em"></label>
  <span id="status"></span>
</p>
<script>
const messages = [];
const log = document.getElementById('log');
const statusLine = document.getElementById('status');
const keyInput = document.getElementById('key');
keyInput.value = localStorage.getItem('pagedlm-key') || '';

function addMessage(role, text) {
  const div = document.createElement('div');
  div.className = 'msg ' + role;
  div.textContent = text;
  log.appendChild(div);
  return div;
}

async function send(text, maxTokens) {
  document.body.dataset.state = 'streaming';
  messages.push({role: 'user', content: text});
  addMessage('user', text);
  const reply = addMessage('assistant', '');
  localStorage.setItem('pagedlm-key', keyInput.value);
  const headers = {'Content-Type': 'application/json'};
  if (keyInput.value) headers['Authorization'] = 'Bearer ' + keyInput.value;
  let content = '';
  try {
    const res = await fetch('/v1/chat/completions', {
      method: 'POST', headers,
      body: JSON.stringify({messages, stream: true, max_tokens: maxTokens, temperature: 0}),
    });
    if (!res.ok) throw new Error((await res.json()).error.message);
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith('data: ') || event === 'data: [DONE]') continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : null;
        if (delta) { content += delta; reply.textContent = content; }
      }
    }
    messages.push({role: 'assistant', content});
    statusLine.textContent = '';
  } catch (e) {
    statusLine.textContent = 'error: ' + e.message;
  }
  document.body.dataset.state = 'done';
}

document.getElementById('form').addEventListener('submit', (e) => {
  e.preventDefault();
  const input = document.getElementById('input');
  if (!input.value.trim()) return;
  send(input.value, parseInt(document.getElementById('max').value, 10) || 256);
  input.value = '';
});

const params = new URLSearchParams(location.search);
if (params.get('prompt')) send(params.get('prompt'), parseInt(params.get('max_tokens') || '32', 10));
</script>
</body>
</html>
)html";

}  // namespace pagedlm::server
