"""Open the built book in headless Chromium and fail on a missing figure, a broken image, an
asset fetched from the network, equations MathJax did not typeset, or a table that does not fit
the page at a laptop width (one that runs past the text column or is cut by it, instead of
scrolling inside its own box).

Serves ``book/_build/html`` on 127.0.0.1 (loopback only), loads every results page (plus the
introduction) inside a same-origin checker page that waits for the images and reports each one's
``naturalWidth``, and saves a full-page screenshot of every page. Exit status 1 when a results
page has no figure, an image that did not load (naturalWidth == 0), or a figure glued as text
("<Figure size ...>"); 0 otherwise.

    .venv/bin/python scripts/check_book_browser.py [--html book/_build/html] [--out runs/browser]

Needs Debian's ``chromium`` (``apt-get install chromium``).
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

CHECKER = """<!doctype html><html><body><pre id="result">pending</pre>
<iframe id="f" style="height:2000px"></iframe>
<script>
const q = new URLSearchParams(location.search);
const page = q.get("page");
const f = document.getElementById("f");
f.style.width = (q.get("width") || "1280") + "px";
f.onload = async () => {
  const doc = f.contentDocument;
  const imgs = Array.from(doc.querySelectorAll("main img, article img, .bd-article img"));
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = r; i.onerror = r; })));
  const mj = f.contentWindow.MathJax;
  if (mj && mj.startup && mj.startup.promise) { await mj.startup.promise; }
  const text = doc.body ? doc.body.innerText : "";
  const remote = Array.from(doc.querySelectorAll("script[src], link[rel=stylesheet], img[src]"))
    .map(e => e.getAttribute("src") || e.getAttribute("href")).filter(u => /^(https?:)?\/\//.test(u));
  document.getElementById("result").textContent = JSON.stringify({
    page, title: doc.title,
    images: imgs.map(i => ({src: i.getAttribute("src"), naturalWidth: i.naturalWidth})),
    glued_as_text: (text.match(/<Figure size [^>]*>/g) || []).length,
    remote_assets: remote, math: doc.querySelectorAll("mjx-container").length,
    raw_math: doc.querySelectorAll(".math").length,
    tables: tableFit(doc, f.contentWindow),
  });
};
// each table of the article: does it fit the text column, scroll inside a box, or get cut?
function tableFit(doc, win) {
  const main = doc.querySelector(".bd-article, article, main") || doc.body;
  const right = main.getBoundingClientRect().right;
  return Array.from(main.querySelectorAll("table")).map(t => {
    const r = t.getBoundingClientRect();
    let scrolls = false, clipRight = Infinity;
    for (let a = t.parentElement; a && a !== main.parentElement; a = a.parentElement) {
      const ox = win.getComputedStyle(a).overflowX;
      if (ox === "auto" || ox === "scroll") { scrolls = true; clipRight = Math.min(clipRight, a.getBoundingClientRect().right); break; }
      if (ox === "hidden" || ox === "clip") { clipRight = Math.min(clipRight, a.getBoundingClientRect().right); }
    }
    const visibleRight = Math.min(r.right, clipRight);
    return {cls: t.className, width: Math.round(r.width), scrolls,
            cut: !scrolls && r.right > clipRight + 1, past_page: visibleRight > right + 1};
  });
}
f.src = page;
</script></body></html>"""


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("chromium not found: apt-get install chromium")


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            if self.path.startswith("/__check.html"):
                body = CHECKER.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def chromium(exe: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    base = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--metrics-recording-only", "--no-default-browser-check"]
    return subprocess.run(base + list(args), capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", default="book/_build/html", help="built book (default book/_build/html)")
    ap.add_argument("--out", default="runs/browser", help="screenshots folder (default runs/browser)")
    ap.add_argument("--width", type=int, default=1400, help="window width in pixels (default 1400, a laptop)")
    ap.add_argument("--height", type=int, default=3000, help="screenshot height in pixels (default 3000)")
    args = ap.parse_args(argv)
    html, out = Path(args.html), Path(args.out)
    if not (html / "index.html").exists():
        raise SystemExit(f"{html}/index.html not found: build the book first (wavesurf reproduce)")
    pages = sorted(p.relative_to(html).as_posix() for p in html.glob("results/*/*.html"))
    pages += sorted(p.relative_to(html).as_posix() for p in html.glob("across-models/*.html"))
    results_pages = set(pages)
    pages = ["intro.html", "methods.html"] + pages
    if not results_pages:
        print("FAIL: the book has no results pages")
        return 1
    exe = find_chromium()
    out.mkdir(parents=True, exist_ok=True)
    server, port = serve(html)
    problems: list[str] = []
    try:
        for page in pages:
            url = f"http://127.0.0.1:{port}/__check.html?page=/{page}&width={args.width}"
            proc = chromium(exe, "--virtual-time-budget=20000", "--dump-dom", url)
            m = re.search(r'<pre id="result">(.*?)</pre>', proc.stdout, re.S)
            raw = m.group(1) if m else ""
            try:
                info = json.loads(raw.replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
            except ValueError:
                problems.append(f"{page}: the checker did not report ({raw[:80]!r}; {proc.stderr.strip()[-200:]})")
                continue
            broken = [i["src"] for i in info["images"] if i["naturalWidth"] == 0]
            shot = out / (page.replace("/", "__").removesuffix(".html") + ".png")
            chromium(exe, f"--window-size={args.width},{args.height}", f"--screenshot={shot.resolve()}",
                     f"http://127.0.0.1:{port}/{page}")
            status = "ok"
            if broken:
                problems.append(f"{page}: broken image(s) {broken}")
                status = "BROKEN IMAGE"
            if page in results_pages and not info["images"]:
                problems.append(f"{page}: no figure on a results page")
                status = "NO FIGURE"
            if info["remote_assets"]:
                problems.append(f"{page}: assets loaded from the network {info['remote_assets']}")
                status = "REMOTE ASSET"
            if info["raw_math"] and not info["math"]:
                problems.append(f"{page}: {info['raw_math']} equations were not typeset (MathJax did not run)")
                status = "NO MATH"
            if info["glued_as_text"]:
                problems.append(f"{page}: {info['glued_as_text']} figure(s) rendered as '<Figure size ...>' text")
                status = "FIGURE AS TEXT"
            unfit = [t for t in info.get("tables", []) if t["cut"] or t["past_page"]]
            if unfit:
                problems.append(f"{page}: {len(unfit)} table(s) do not fit at {args.width} px "
                                f"({', '.join(('cut' if t['cut'] else 'past the page') + ' ' + str(t['width']) + ' px' for t in unfit)})")
                status = "TABLE UNFIT"
            scrolling = sum(t["scrolls"] for t in info.get("tables", []))
            print(f"{status:<14} {page}  ({len(info['images'])} images, {info['math']} equations typeset, "
                  f"{len(info.get('tables', []))} tables, {scrolling} scroll in their box) -> {shot}")
    finally:
        server.shutdown()
    if problems:
        print("\n".join(["FAIL:"] + problems))
        return 1
    print(f"all {len(pages)} pages have their figures; screenshots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
