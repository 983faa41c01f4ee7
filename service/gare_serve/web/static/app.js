// GARE search page: no framework, no external resources. Everything from the API is inserted with
// textContent / attributes (never innerHTML), so metadata cannot inject markup.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const form = $("search-form"), q = $("q"), go = $("go"), statusEl = $("status"), timingsEl = $("timings");
  const results = $("results"), keyLabel = $("key-label"), keyInput = $("api-key");
  const player = $("player"), playerBox = $("player-box");

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = keyInput.value || sessionStorage.getItem("gare-api-key") || "";
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function fmt(x, digits) {
    return (x === null || x === undefined) ? "–" : Number(x).toFixed(digits === undefined ? 3 : digits);
  }

  function secs(x) {
    if (x === null || x === undefined) return "";
    const m = Math.floor(x / 60), s = x - 60 * m;
    return (m ? m + ":" + (s < 10 ? "0" : "") : "") + s.toFixed(1) + (m ? "" : " s");
  }

  function setStatus(text, isError) {
    statusEl.textContent = text;
    statusEl.classList.toggle("error", !!isError);
  }

  async function apiFetch(url, options) {
    const resp = await fetch(url, options);
    if (resp.status === 401 || resp.status === 403) keyLabel.hidden = false;
    return resp;
  }

  // The filter box: empty = no filter; otherwise a JSON object, checked here before any request is sent.
  const filterInput = $("filter");
  function readFilter() {
    const text = filterInput.value.trim();
    if (!text) return { ok: true, value: undefined };
    let value;
    try { value = JSON.parse(text); } catch (e) { return { ok: false, error: "filter is not valid JSON: " + e.message }; }
    if (value === null || typeof value !== "object" || Array.isArray(value)) {
      return { ok: false, error: "filter must be a JSON object, e.g. {\"year\": {\"$gte\": 2020}}" };
    }
    return { ok: true, value: value };
  }
  filterInput.addEventListener("input", () => {
    const f = readFilter();
    filterInput.classList.toggle("invalid", !f.ok);
    filterInput.setAttribute("aria-invalid", f.ok ? "false" : "true");
  });

  // The server's error detail: a message (a bad filter names the place, e.g. filter.year.$gte), or validation items.
  function detailText(detail, fallback) {
    if (typeof detail === "string") return detail;
    if (Array.isArray(detail)) {
      return detail.map((d) => ((d && d.loc) ? d.loc.join(".") + ": " : "") + ((d && d.msg) || JSON.stringify(d))).join("; ");
    }
    return detail ? JSON.stringify(detail) : fallback;
  }

  let nclTouched = false;
  $("ncl").addEventListener("change", () => { nclTouched = true; });
  // Footer: what the index measured about stage 1 when it was built (GET /v1/index stage1).
  function stage1Text(info) {
    const st = info.stage1;
    if (!st) return "Stage 1 not tuned; default K " + info.default_candidates + ".";
    const K = st.default_candidates;
    const cov = K && st.coverage ? st.coverage[String(K)] : null;
    return "Stage 1: recall@" + st.recall_at + " of the exact top-" + st.recall_k + " " + Number(st.recall).toFixed(4) +
      " (target " + st.recall_target + "), " + st.index_type + " " + (st.setting || "") + ", p50 " +
      Number(st.p50_ms).toFixed(2) + " ms; psi top-" + st.coverage_top + " inside the top-" + (K || "?") + ": " +
      (cov === null || cov === undefined ? "n/a" : (100 * cov).toFixed(2) + "%") + " (default K " +
      info.default_candidates + "); queries: " + st.query_source + ".";
  }

  async function loadIndexInfo() {
    try {
      const resp = await apiFetch("/v1/index", { headers: headers() });
      if (!resp.ok) { $("index-info").textContent = "index information unavailable (" + resp.status + ")"; return; }
      const info = await resp.json();
      $("index-info").textContent = "index " + info.version + " · " + info.n + " entries · " + info.index_type +
        " · " + (info.checkpoint && info.checkpoint.name ? info.checkpoint.name : "checkpoint") + " · " + info.device;
      // the server says what ncl defaults to and why (GET /v1/index); a box the user already touched is left alone
      if (typeof info.ncl_default === "boolean" && !nclTouched) { $("ncl").checked = info.ncl_default; }
      if (info.ncl_default_reason) {
        $("ncl-label").title = info.ncl_default_reason + (info.biases_description ? " · biases: " + info.biases_description : "");
      }
      $("stage1-info").textContent = stage1Text(info);
    } catch (e) {
      $("index-info").textContent = "index information unavailable";
    }
  }

  function card(hit) {
    // A div with role=button (not a <button>): it holds the "more like this" button, and buttons do not nest.
    const b = document.createElement("div");
    b.setAttribute("role", "button");
    b.tabIndex = 0;
    b.className = "card";
    b.dataset.id = String(hit.id);
    b.dataset.start = hit.start === null ? "" : String(hit.start);
    const img = document.createElement("img");
    img.loading = "lazy";
    img.alt = hit.metadata && hit.metadata.name ? hit.metadata.name : "video " + hit.id;
    img.src = hit.thumbnail_url;
    const body = document.createElement("div");
    body.className = "body";
    const name = document.createElement("div");
    name.className = "name";
    const rank = document.createElement("span");
    rank.className = "rank";
    rank.textContent = "#" + hit.rank;
    name.appendChild(rank);
    name.appendChild(document.createTextNode((hit.metadata && hit.metadata.path) || ("video " + hit.id)));
    name.title = (hit.metadata && hit.metadata.path) || "";
    const scores = document.createElement("div");
    scores.className = "scores";
    scores.textContent = "score " + fmt(hit.score);
    const parts = document.createElement("div");
    parts.className = "scores";
    parts.textContent = "ann " + fmt(hit.ann_score) + (hit.psi_score === null ? "" : " · psi " + fmt(hit.psi_score)) +
      " · bias " + fmt(hit.bias);
    body.appendChild(name);
    body.appendChild(scores);
    body.appendChild(parts);
    if (hit.start !== null || hit.end !== null) {
      const seg = document.createElement("div");
      seg.className = "seg";
      seg.textContent = "segment " + secs(hit.start || 0) + " – " + secs(hit.end);
      body.appendChild(seg);
    }
    const more = document.createElement("button");
    more.type = "button";
    more.className = "more";
    more.textContent = "more like this";
    more.title = "find videos like this one (stage 1 with its vector, rerank by frame matching)";
    more.addEventListener("click", (ev) => { ev.stopPropagation(); moreLikeThis(hit); });
    body.appendChild(more);
    b.appendChild(img);
    b.appendChild(body);
    b.addEventListener("click", () => play(hit));
    b.addEventListener("keydown", (ev) => { if (ev.target === b && (ev.key === "Enter" || ev.key === " ")) { ev.preventDefault(); play(hit); } });
    return b;
  }

  function play(hit) {
    const start = hit.start || 0;
    // The media fragment starts playback at the segment; currentTime is set too for browsers that ignore it.
    const src = hit.video_url + (start > 0 ? "#t=" + start + (hit.end !== null ? "," + hit.end : "") : "");
    player.dataset.start = String(start);
    player.dataset.id = String(hit.id);
    player.src = src;
    const seek = () => {
      if (Math.abs(player.currentTime - start) > 0.05) {
        try { player.currentTime = start; } catch (e) { /* not seekable yet */ }
      }
    };
    player.addEventListener("loadedmetadata", seek, { once: true });
    $("player-title").textContent = (hit.metadata && hit.metadata.path) || ("video " + hit.id);
    $("player-meta").textContent = "id " + hit.id + " · score " + fmt(hit.score) +
      (hit.start !== null ? " · from " + secs(start) : "") +
      (hit.metadata && hit.metadata.duration ? " · duration " + secs(hit.metadata.duration) : "");
    playerBox.hidden = false;
    player.play().catch(() => { /* autoplay may be blocked; the controls remain */ });
    playerBox.scrollIntoView({ behavior: "smooth", block: "nearest" });
  }

  $("player-close").addEventListener("click", () => {
    player.pause();
    player.removeAttribute("src");
    player.load();
    playerBox.hidden = true;
  });

  // What the switches re-run: the last text query, "more like this" video or image.
  let last = { kind: "text" };

  function describe(data) {
    const ex = data.example;
    if (!ex) return "for “" + data.query + "”";
    if (ex.kind === "videos") return "like video " + ex.ids.join(", ") + " (frame matching, no psi)";
    return "for the image " + (last.name || "") + " (stage 1 only)";
  }

  function moreLikeThis(hit) {
    last = { kind: "videos", id: hit.id, name: (hit.metadata && hit.metadata.path) || ("video " + hit.id) };
    run({ video_id: hit.id, k: parseInt($("k").value, 10), rerank: $("rerank").checked });
  }

  function searchImage(file) {
    if (!file) return;
    if (!/^image\/(jpeg|png|webp|gif)$/.test(file.type)) {
      setStatus("not an image the server accepts (" + (file.type || "unknown type") + "): use JPEG, PNG, WebP or GIF", true);
      return;
    }
    last = { kind: "image", file: file, name: file.name };
    run(null, file);
  }

  async function search(ev) {
    if (ev) ev.preventDefault();
    const query = q.value.trim();
    if (!query) { setStatus("type a query first", true); return; }
    last = { kind: "text" };
    await run({ query: query, k: parseInt($("k").value, 10), rerank: $("rerank").checked, ncl: $("ncl").checked });
  }

  function rerun() {
    if (last.kind === "videos") moreLikeThis({ id: last.id, metadata: { path: last.name } });
    else if (last.kind === "image") searchImage(last.file);
    else if (q.value.trim()) search();
  }

  async function run(body, file) {
    if (keyInput.value) sessionStorage.setItem("gare-api-key", keyInput.value);
    const filter = readFilter();
    if (!filter.ok) { setStatus(filter.error, true); filterInput.focus(); return; }
    go.disabled = true;
    setStatus("searching…");
    const t0 = performance.now();
    try {
      let resp;
      if (file) {
        const fd = new FormData();
        fd.append("image", file, file.name);
        fd.append("k", $("k").value);
        if (filter.value !== undefined) fd.append("filter", JSON.stringify(filter.value));
        resp = await apiFetch("/v1/search/image", { method: "POST", headers: headers(), body: fd });
      } else {
        resp = await apiFetch("/v1/search", {
          method: "POST", headers: headers({ "Content-Type": "application/json" }),
          body: JSON.stringify(filter.value === undefined ? body : Object.assign({}, body, { filter: filter.value })),
        });
      }
      const data = await resp.json().catch(() => ({}));
      if (!resp.ok) {
        setStatus("error " + resp.status + ": " + detailText(data.detail, resp.statusText), true);
        return;
      }
      results.replaceChildren(...data.results.map(card));
      const rtt = performance.now() - t0;
      setStatus(data.results.length + " results " + describe(data) + (filter.value !== undefined ? " matching the filter" : "") +
        " (index " + data.index_version + ")");
      const t = data.timings_ms;
      timingsEl.textContent = "server " + fmt(t.total, 1) + " ms = queue " + fmt(t.queue, 1) + " + encode " +
        fmt(t.encode, 1) + " + ANN " + fmt(t.ann, 1) + " + rerank " + fmt(t.rerank, 1) + " ms (batch of " +
        data.batch_size + ") · round trip " + rtt.toFixed(1) + " ms" +
        (t.plan ? " · filter " + fmt(t.filter, 1) + " ms, stage 1 plan " + t.plan : "");
      timingsEl.dataset.total = String(t.total);
    } catch (e) {
      setStatus("request failed: " + e, true);
    } finally {
      go.disabled = false;
    }
  }

  form.addEventListener("submit", search);
  for (const id of ["rerank", "ncl", "k"]) {
    $(id).addEventListener("change", rerun);
  }
  // Search by image: choose a file, or drop one on the search box.
  $("image").addEventListener("change", (ev) => searchImage(ev.target.files[0]));
  form.addEventListener("dragover", (ev) => { ev.preventDefault(); form.classList.add("dropping"); });
  form.addEventListener("dragleave", () => form.classList.remove("dropping"));
  form.addEventListener("drop", (ev) => {
    ev.preventDefault();
    form.classList.remove("dropping");
    const f = ev.dataTransfer && ev.dataTransfer.files && ev.dataTransfer.files[0];
    if (f) searchImage(f);
  });
  loadIndexInfo();
})();
