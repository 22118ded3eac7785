"""Headless Chromium loads the chat page, which streams a reply from /v1/chat/completions; the
reply shown must equal the API's own answer. Chromium is driven over the DevTools protocol on
a pipe (--remote-debugging-pipe: NUL-separated JSON on fds 3 and 4), so no extra packages."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from server_harness import Server, parse_args, post_json, root, run_checks, skip

PROMPT = "Hi there!"
MAX_TOKENS = 8


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if root() and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True,
                       env=env)
    return shutil.which("chromium")


class DevTools:
    def __init__(self, chromium, profile):
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()
        # Chromium reads commands from fd 3 and writes replies to fd 4. Copy both ends above
        # 4 first, so placing one cannot overwrite the other; pass_fds keeps 3 and 4 open.
        def child_fds():
            reader, writer = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(reader, 3)
            os.dup2(writer, 4)
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=child_fds, pass_fds=(3, 4), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.next_id = 0
        self.buffer = b""

    def call(self, method, session=None, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self.to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                data = os.read(self.from_chrome, 65536)
                if not data:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self.buffer += data
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def close(self):
        # Chromium's own children (renderer, zygote) share its new process group.
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def main():
    args = parse_args()
    chromium = find_chromium()
    if not chromium:
        skip("chromium is not installed and could not be installed")
    with Server(args.pagedlm, args.model) as server, tempfile.TemporaryDirectory(
            ignore_cleanup_errors=True) as profile:

        def check_page_streams_reply():
            status, body = post_json(server, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": MAX_TOKENS, "temperature": 0})
            assert status == 200, body
            expected = body["choices"][0]["message"]["content"]
            browser = DevTools(chromium, profile)
            try:
                target = browser.call("Target.createTarget", url="about:blank")["targetId"]
                session = browser.call("Target.attachToTarget", targetId=target,
                                       flatten=True)["sessionId"]
                browser.call("Page.enable", session)
                url = f"{server.base_url}/?prompt={PROMPT.replace(' ', '%20')}" \
                      f"&max_tokens={MAX_TOKENS}"
                browser.call("Page.navigate", session, url=url)

                def evaluate(expr):
                    return browser.call("Runtime.evaluate", session, expression=expr,
                                        returnByValue=True)["result"].get("value")

                deadline = time.time() + 60
                while evaluate("document.body && document.body.dataset.state") != "done":
                    assert time.time() < deadline, "the page did not finish streaming"
                    time.sleep(0.2)
                shown = evaluate("document.querySelector('.msg.assistant').textContent")
                error = evaluate("document.getElementById('status').textContent")
            finally:
                browser.close()
            assert not error, error
            assert shown == expected, (shown, expected)

        run_checks([("chat page streams a reply in headless Chromium",
                     check_page_streams_reply)])


if __name__ == "__main__":
    main()
