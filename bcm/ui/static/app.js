// bcm dashboard: a few lines that make pages live; every page works without them.
"use strict";
(function () {
  const POLL_MS = 5000, MAX_POLLS = 720; // bounded: an hour of polling per page load, then a note
  let etag = null, polls = 0, timer = null;

  function checkedNodes() {
    return new Set(Array.from(document.querySelectorAll('input[name="node"]:checked')).map(i => i.value));
  }

  async function refresh() {
    const regions = document.querySelectorAll("[data-live]");
    if (!regions.length) return;
    const headers = etag ? { "If-None-Match": etag } : {};
    const r = await fetch(location.href, { headers, credentials: "same-origin", cache: "no-store" });
    if (r.redirected || r.status === 401) { location.reload(); return; }
    if (r.status !== 200) return;
    etag = r.headers.get("ETag");
    const doc = new DOMParser().parseFromString(await r.text(), "text/html");
    const keep = checkedNodes();
    regions.forEach(old => {
      if (old.contains(document.activeElement) && document.activeElement !== document.body) return;
      const fresh = doc.getElementById(old.id);
      if (fresh) old.replaceWith(document.importNode(fresh, true));
    });
    document.querySelectorAll('input[name="node"]').forEach(i => { i.checked = keep.has(i.value); });
    wireSelectAll();
  }

  function schedule() {
    if (!document.querySelector("[data-live]")) return;
    timer = setTimeout(async () => {
      if (!document.hidden) {
        polls += 1;
        try { await refresh(); } catch (e) { /* the next poll tries again */ }
      }
      if (polls < MAX_POLLS) schedule();
      else {
        const note = document.createElement("p");
        note.className = "muted live-note";
        note.textContent = "Live updates paused; reload the page to resume.";
        document.querySelector("main").prepend(note);
      }
    }, POLL_MS);
  }

  function wireSelectAll() {
    const all = document.getElementById("select-all");
    if (!all || all.dataset.wired) return;
    all.dataset.wired = "1";
    all.addEventListener("change", () => {
      document.querySelectorAll('input[name="node"]').forEach(i => { i.checked = all.checked; });
    });
  }

  function followLog() {
    const pre = document.getElementById("op-log");
    if (!pre || !pre.dataset.stream) return;
    const es = new EventSource(pre.dataset.stream + "?from=" + encodeURIComponent(pre.dataset.offset || "0"));
    const show = d => {
      if (d.log) {
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.append(document.createTextNode(d.log));
        if (atEnd) pre.scrollTop = pre.scrollHeight;
      }
      const state = document.getElementById("op-state");
      if (state && d.state) { state.textContent = d.state; state.className = "op op-" + d.state; }
      const progress = document.getElementById("op-progress");
      if (progress && d.total !== undefined) progress.textContent = d.done + "/" + d.total;
    };
    es.onmessage = e => show(JSON.parse(e.data));
    es.addEventListener("end", e => {
      show(JSON.parse(e.data));
      es.close();
      pre.dataset.ended = "1";
      const end = document.getElementById("op-end");
      if (end) { end.hidden = false; end.textContent = "The operation has ended (" + JSON.parse(e.data).state + ")."; }
      refresh().catch(() => {});
    });
  }

  document.addEventListener("DOMContentLoaded", () => { wireSelectAll(); followLog(); schedule(); });
})();
