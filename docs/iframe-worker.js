/* Web workers for a book read from disk. A page opened from file:// may not start
   `new Worker(url)` (Chromium refuses it), and the book's search runs in a worker, so
   from disk it would never leave "Initializing search". On such a page this replaces Worker with
   one that runs the worker's script in a hidden iframe and passes messages both ways, with no
   network: Material's offline plugin (mkdocs.yml) otherwise loads a shim from unpkg.com, and it
   looks for a script named "iframe-worker" among extra.polyfills to know one is there. Over http
   nothing changes. */
(() => {
  if (location.protocol !== "file:") return;

  class FrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.queue = [];  // messages posted before the worker's script has loaded
      this.frame = document.createElement("iframe");
      this.frame.hidden = true;
      (document.body || document.documentElement).appendChild(this.frame);
      const inner = this.frame.contentWindow;
      inner.postMessage = data => setTimeout(() => this.receive(data));  // the worker's replies
      inner.importScripts = () => { throw new Error("importScripts: not available to a page read from disk"); };
      const script = inner.document.createElement("script");
      script.src = new URL(url, location.href).href;
      script.onload = () => {
        const queued = this.queue;
        this.queue = null;
        queued.forEach(data => this.postMessage(data));
      };
      inner.document.head.appendChild(script);
    }

    receive(data) {
      const event = new MessageEvent("message", {data});
      if (this.onmessage) this.onmessage(event);
      this.dispatchEvent(event);
    }

    postMessage(data) {
      if (this.queue) return void this.queue.push(data);
      const inner = this.frame.contentWindow;
      setTimeout(() => inner.dispatchEvent(new inner.MessageEvent("message", {data})));
    }

    terminate() {
      this.frame.remove();
    }
  }

  window.Worker = FrameWorker;
})();
