/* The chat page: one conversation with the served model over our own /v1/chat/completions stream.

   - History lives in this page (S.history, OpenAI messages); "New chat" empties it. Every request of one
     conversation carries the same X-Session-Id (a new random one per conversation), which a proxy in front of
     several boards hashes to keep the conversation on the board holding its prefix cache.
   - Each answer streams event by event (fetch + SSEParser); Stop aborts the fetch, and the server cancels the
     generation when the connection closes. Qwen3's reasoning_content goes into a collapsible block apart from
     the answer; the Think switch sends chat_template_kwargs.enable_thinking.
   - 401: ask for the API key once, keep it in localStorage, retry. 429 / 503: show busy / loading and retry
     after Retry-After (Stop gives up). `: queued` / `: prefill` comments show that the request waits.
   - Images (vision models only): attached, dropped or pasted; resized here to the pixel budget /props gives,
     re-encoded as JPEG and sent as data: URIs.
   - The page's API paths are relative to where it is served (/ or /chat/), so a reverse proxy may mount it
     under a prefix. */
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  };
  const store = {
    get(k, d) { try { const v = localStorage.getItem(k); return v === null ? d : v; } catch (e) { return d; } },
    set(k, v) { try { localStorage.setItem(k, v); } catch (e) { /* private mode: keep it in memory */ } },
  };
  const KEY_ITEM = "kestrel.apiKey";
  const THINK_ITEM = "kestrel.enableThinking";
  const ROOT = new URL(location.pathname.replace(/chat\/?$/, "").replace(/[^/]*$/, ""), location.origin);

  const S = {
    model: "", ready: false, props: null, key: store.get(KEY_ITEM, ""),
    history: [],        // the conversation as OpenAI messages
    session: "",        // its X-Session-Id (newSession)
    attachments: [],    // images waiting to be sent: {url, w, h, name}
    run: null,          // the generation in flight
    health: null,       // the last /health answer
    loadingInfo: false,
  };

  const ui = {
    log: $("log"), empty: $("empty"), input: $("input"), send: $("send"), stop: $("stop"), attach: $("attach"),
    file: $("file"), atts: $("attachments"), think: $("think"), thinkWrap: $("think-wrap"), model: $("model"),
    state: $("state"), dot: $("dot"), drop: $("drop"), dlg: $("keydlg"), key: $("key"), keymsg: $("keymsg"),
  };

  // ---- API ---------------------------------------------------------------------------------------------
  /* 128 random bits as hex; crypto.getRandomValues works on plain http (randomUUID needs a secure context). */
  function newSession() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    S.session = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function api(path, init = {}) {
    const headers = new Headers(init.headers || {});
    if (S.key) headers.set("Authorization", "Bearer " + S.key);
    return fetch(new URL(path, ROOT), {...init, headers, cache: "no-store"});
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return "The server answered " + r.status + ".";
  }

  const sleep = (ms, signal) => new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); reject(new DOMException("stopped", "AbortError")); },
      {once: true});
  });

  // ---- API key dialog ------------------------------------------------------------------------------------
  let keyWaiters = null;
  function askKey(message) {
    if (!keyWaiters) {
      keyWaiters = [];
      ui.keymsg.textContent = message;
      ui.key.value = "";
      ui.dlg.showModal();
      ui.key.focus();
    }
    return new Promise((resolve) => keyWaiters.push(resolve));
  }
  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = ui.key.value.trim();
    if (!key) return;
    S.key = key;
    store.set(KEY_ITEM, key);
    ui.dlg.close();
    const waiters = keyWaiters || [];
    keyWaiters = null;
    waiters.forEach((w) => w());
    ui.input.focus();
  });
  ui.dlg.addEventListener("cancel", (e) => e.preventDefault());  // the page cannot work without it

  async function needKey(r) {
    const why = await errorText(r);
    await askKey(S.key ? "That key was not accepted (" + why + ") Enter the API key." : "This appliance needs an API key.");
  }

  // ---- model, readiness, busy ----------------------------------------------------------------------------
  function setState(kind, text) {
    ui.dot.className = "dot " + kind;
    ui.state.textContent = text;
    document.body.dataset.state = kind;
  }

  function showHealth() {
    const h = S.health;
    if (!h) return;
    if (h.kind !== "ready") return setState(h.kind, h.text);
    if (S.run && S.run.answering) return setState("working", "answering");
    const waiting = h.body.queue_depth || 0;
    if (h.body.busy || waiting) return setState("busy", waiting ? "busy · " + waiting + " waiting" : "busy");
    setState("ready", "ready");
  }

  async function checkHealth() {
    try {
      const r = await api("health");
      const body = await r.json().catch(() => ({}));
      if (r.ok) S.health = {kind: "ready", body};
      else S.health = {kind: "loading", text: body.status === "loading" ? "loading the model…" : "unavailable"};
    } catch (e) {
      S.health = {kind: "offline", text: "offline, retrying…"};
    }
    const wasReady = S.ready;
    S.ready = S.health.kind === "ready";
    showHealth();
    if (S.ready && !S.loadingInfo && (!wasReady || !S.props || !S.props.default_generation_settings)) {
      S.loadingInfo = true;  // one at a time (it may be waiting for the API key)
      loadInfo().finally(() => { S.loadingInfo = false; });
    }
  }

  async function poll() {
    await checkHealth();
    setTimeout(poll, S.ready ? 3000 : 1000);
  }

  async function loadInfo() {
    try {
      const models = await (await api("v1/models")).json();
      S.model = models.data[0].id;
      ui.model.textContent = S.model;
      ui.model.title = S.model;
      $("empty-model").textContent = S.model;
      document.title = S.model + " · Kestrel chat";
    } catch (e) { /* shown by the health line */ }
    for (;;) {
      let r;
      try { r = await api("props"); } catch (e) { return; }
      if (r.status === 401) { await needKey(r); continue; }
      if (r.ok) S.props = await r.json();
      break;
    }
    const vision = !!(S.props && S.props.modalities && S.props.modalities.vision);
    ui.attach.hidden = !vision;
    $("img-hint").hidden = !vision;
    ui.thinkWrap.hidden = !!S.props && S.props.thinking_toggle === false;
  }

  // ---- images ----------------------------------------------------------------------------------------------
  function pixelBudget() {
    const img = S.props && S.props.image;
    if (!img) return 0;
    const ctx = (S.props.default_generation_settings || {}).n_ctx || 4096;
    // at most a quarter of the context for one image, and never past the model's own bound
    return Math.max(img.min_pixels || 0, Math.min(img.max_pixels, img.pixels_per_token * Math.floor(ctx / 4)));
  }

  async function shrink(file) {
    const bitmap = await createImageBitmap(file);
    const budget = pixelBudget();
    const scale = Math.min(1, Math.sqrt(budget / (bitmap.width * bitmap.height)));
    const w = Math.max(1, Math.floor(bitmap.width * scale));   // floor: never past the budget
    const h = Math.max(1, Math.floor(bitmap.height * scale));
    const canvas = el("canvas");
    canvas.width = w;
    canvas.height = h;
    const g = canvas.getContext("2d");
    g.fillStyle = "#fff";  // transparent parts become white, as JPEG has no alpha
    g.fillRect(0, 0, w, h);
    g.imageSmoothingQuality = "high";
    g.drawImage(bitmap, 0, 0, w, h);
    bitmap.close();
    return {url: canvas.toDataURL("image/jpeg", 0.9), w, h, name: file.name || "image"};
  }

  async function addFiles(files) {
    const images = [...files].filter((f) => f.type.startsWith("image/"));
    if (!images.length) return;
    if (!(S.props && S.props.image)) return notice("This model does not read images.");
    for (const f of images) {
      try {
        S.attachments.push(await shrink(f));
      } catch (e) {
        notice("Could not read " + (f.name || "the image") + ".");
      }
    }
    showAttachments();
  }

  function showAttachments() {
    ui.atts.replaceChildren();
    ui.atts.hidden = !S.attachments.length;
    S.attachments.forEach((a, i) => {
      const chip = el("div", "att");
      const img = el("img");
      img.src = a.url;
      img.alt = a.name;
      const rm = el("button", "btn icon small", "×");
      rm.type = "button";
      rm.setAttribute("aria-label", "Remove " + a.name);
      rm.addEventListener("click", () => { S.attachments.splice(i, 1); showAttachments(); ui.input.focus(); });
      chip.append(img, el("span", "att-size", a.w + "×" + a.h), rm);
      ui.atts.append(chip);
    });
  }

  let noticeTimer = 0;
  function notice(text) {
    let n = $("notice");
    if (!n) {
      n = el("div", "notice");
      n.id = "notice";
      n.setAttribute("role", "alert");
      $("composer").prepend(n);
    }
    n.textContent = text;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(() => n.remove(), 5000);
  }

  // ---- the conversation view -------------------------------------------------------------------------------
  let stick = true;  // follow the stream unless the reader scrolled up
  ui.log.addEventListener("scroll", () => {
    stick = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 40;
  });
  // once per frame: reading scrollHeight lays the page out, which per token would grow with the answer
  let following = false;
  const follow = () => {
    if (following) return;
    following = true;
    requestAnimationFrame(() => {
      following = false;
      if (stick) ui.log.scrollTop = ui.log.scrollHeight;
    });
  };

  function addUser(text, images) {
    ui.empty.hidden = true;
    const art = el("article", "msg user");
    if (images.length) {
      const row = el("div", "imgs");
      for (const a of images) {
        const img = el("img");
        img.src = a.url;
        img.alt = a.name;
        row.append(img);
      }
      art.append(row);
    }
    if (text) art.append(el("div", "text", text));
    ui.log.append(art);
    stick = true;
    follow();
    return art;
  }

  function thoughtFor(ms) {
    return "Thought for " + (ms < 1000 ? "under a second" : (ms / 1000).toFixed(ms < 10000 ? 1 : 0) + " s");
  }

  function fmtMs(ms) { return ms >= 1000 ? (ms / 1000).toFixed(1) + " s" : Math.round(ms) + " ms"; }

  function statusText(t, reason) {
    const parts = [];
    if (t) {
      if (t.ttft_ms != null) parts.push("TTFT " + fmtMs(t.ttft_ms));
      if (t.predicted_per_second) parts.push(t.predicted_per_second.toFixed(1) + " tok/s");
      if (t.predicted_n != null) parts.push(t.predicted_n + " tokens");
      if (t.prompt_n != null) {
        let p = "prompt " + t.prompt_n;
        if (t.image_tokens) p += " (" + t.image_tokens + " image)";
        parts.push(p);
      }
      if (t.cache_n) parts.push(t.cache_n + " reused");
    }
    if (reason === "length") parts.push("cut at the length limit");
    return parts.join(" · ");
  }

  /* Streams Markdown into `md` at a cost that does not grow with the answer: text up to the last blank line
     outside a code fence is rendered once and kept; only the open tail is rendered again on each event. The
     finished answer is rendered once more as a whole (a list split by a blank line joins up again). */
  class MarkdownStream {
    constructor(md) {
      this.md = md;
      this.text = "";
      this.frozenLen = 0;    // characters rendered for good
      this.frozenNodes = 0;  // md's children that hold them
      this.scanned = 0;      // characters already scanned for line ends
      this.fence = "";       // the fence of the open code block, if any
    }
    push(t) {
      this.text += t;
      let boundary = -1;
      for (let nl; (nl = this.text.indexOf("\n", this.scanned)) >= 0; this.scanned = nl + 1) {
        const line = this.text.slice(this.scanned, nl);
        const m = /^\s*(`{3,}|~{3,})/.exec(line);
        if (m && !this.fence) this.fence = m[1];
        else if (m && m[1][0] === this.fence[0] && m[1].length >= this.fence.length && !line.trim().slice(m[1].length)) this.fence = "";
        else if (!line.trim() && !this.fence) boundary = nl + 1;
      }
      if (boundary > this.frozenLen && this.text.slice(this.frozenLen, boundary).trim()) {
        this.cut();
        this.md.insertAdjacentHTML("beforeend", Markdown.render(this.text.slice(this.frozenLen, boundary)));
        this.frozenNodes = this.md.childNodes.length;
        this.frozenLen = boundary;
      }
      this.cut();
      this.md.insertAdjacentHTML("beforeend", Markdown.render(this.text.slice(this.frozenLen)));
    }
    cut() {
      while (this.md.childNodes.length > this.frozenNodes) this.md.lastChild.remove();
    }
    finish() {
      this.md.innerHTML = Markdown.render(this.text);
    }
  }

  function addAnswer() {
    const art = el("article", "msg bot live");
    const think = el("details", "think");
    const summary = el("summary", null, "Thinking…");
    const thinkBody = el("div", "think-body");
    think.append(summary, thinkBody);
    think.hidden = true;
    const md = el("div", "md");
    const status = el("div", "status", "");
    status.setAttribute("aria-live", "off");
    art.append(think, md, status);
    ui.log.append(art);
    follow();
    const stream = new MarkdownStream(md);
    let content = "", thinking = "", events = 0, thinkStart = 0, thought = false;
    let countdown = 0;
    const show = (text) => { status.className = "status wait"; status.textContent = text; };
    const wait = (text) => { clearInterval(countdown); show(text); };
    const took = (label) => {  // one more event shown
      wait(label);
      art.dataset.events = ++events;
      follow();
    };
    wait("Sending…");
    return {
      el: art,
      get content() { return content; },
      get thinking() { return thinking; },
      get events() { return events; },
      waiting(comment) {
        if (content || thinking) return;
        if (comment === "queued") {
          const h = S.health && S.health.body;
          wait(h && h.queue_depth > 1 ? "Waiting in line (" + h.queue_depth + " waiting)…" : "Waiting in line…");
        } else if (comment === "prefill") {
          wait("Reading the prompt…");
        }
      },
      started() { wait("Reading the prompt…"); },
      busy(status, seconds) {
        const why = status === 429 ? "The appliance is busy with other requests" : "The model is still loading";
        wait(why + " — trying again in " + seconds + " s…");
        countdown = setInterval(() => { if (--seconds > 0) show(why + " — trying again in " + seconds + " s…"); }, 1000);
        art.classList.add("busy");
      },
      reasoning(text) {
        if (!thinking) { think.hidden = false; think.open = true; thinkStart = performance.now(); }
        thinking += text;
        thinkBody.append(text);
        took("Thinking…");
      },
      text(t) {
        art.classList.remove("busy");
        if (thinking && !thought) {
          thought = true;
          think.open = false;
          summary.textContent = thoughtFor(performance.now() - thinkStart);
        }
        content += t;
        stream.push(t);
        took("Writing…");
      },
      error(text) {
        art.classList.add("failed");
        art.classList.remove("busy");
        const e = el("div", "error", text);
        e.setAttribute("role", "alert");
        art.insertBefore(e, status);
      },
      done(run) {
        clearInterval(countdown);
        art.classList.remove("live");
        if (content) stream.finish();
        thinkBody.normalize();
        if (thinking && !thought) summary.textContent = thoughtFor(performance.now() - thinkStart);
        status.className = "status";
        const line = statusText(run.timings, run.finish);
        status.textContent = run.stopped ? "Stopped" + (events ? " after " + events + " tokens" : "") : line;
        if (!content && !thinking && !art.querySelector(".error")) md.textContent = run.stopped ? "" : "(no answer)";
        follow();
      },
    };
  }

  // ---- sending and streaming ------------------------------------------------------------------------------
  function setRunning(on) {
    ui.send.hidden = on;
    ui.stop.hidden = !on;
    ui.log.setAttribute("aria-busy", on ? "true" : "false");
    if (on && document.activeElement === ui.send) ui.stop.focus();
    showHealth();
  }

  function send() {
    if (S.run) return;
    const text = ui.input.value.trim();
    if (!text && !S.attachments.length) return;
    const images = S.attachments;
    const content = images.length
      ? [...images.map((a) => ({type: "image_url", image_url: {url: a.url}})), ...(text ? [{type: "text", text}] : [])]
      : text;
    const message = {role: "user", content};
    S.history.push(message);
    const view = addUser(text, images);
    ui.input.value = "";
    S.attachments = [];
    showAttachments();
    autosize();
    generate(message, view, text, images);
  }

  function onEvent(run, ev) {
    if (ev.data === "[DONE]") return;
    let obj;
    try { obj = JSON.parse(ev.data); } catch (e) { return; }
    if (obj.error) {
      run.failed = true;
      run.view.error(obj.error.message || "The generation failed.");
      return;
    }
    if (obj.object !== "chat.completion.chunk") return;  // extension events
    const choice = obj.choices && obj.choices[0];
    if (choice) {
      const d = choice.delta || {};
      if (!run.answering && (d.content || d.reasoning_content)) {
        run.answering = true;
        showHealth();
      }
      if (d.reasoning_content) run.view.reasoning(d.reasoning_content);
      if (d.content) run.view.text(d.content);
      if (choice.finish_reason) run.finish = choice.finish_reason;
    }
    if (obj.timings) run.timings = obj.timings;
  }

  async function generate(message, userView, text, images) {
    const run = {ctrl: new AbortController(), view: addAnswer(), stopped: false, failed: false};
    S.run = run;
    setRunning(true);
    const body = JSON.stringify({
      model: S.model || "model", stream: true, messages: S.history,
      chat_template_kwargs: {enable_thinking: ui.think.checked},
    });
    try {
      for (;;) {
        const r = await api("v1/chat/completions", {method: "POST", body, signal: run.ctrl.signal,
                                                     headers: {"Content-Type": "application/json",
                                                               "X-Session-Id": S.session}});
        if (r.status === 401) { await needKey(r); continue; }
        if (r.status === 429 || r.status === 503) {
          const seconds = Math.min(60, Math.max(1, parseInt(r.headers.get("Retry-After"), 10) || 1));
          run.view.busy(r.status, seconds);
          await sleep(seconds * 1000, run.ctrl.signal);
          continue;
        }
        if (!r.ok) {
          run.failed = true;
          run.view.error(await errorText(r));
          break;
        }
        run.view.started();
        await readSSE(r, (ev) => onEvent(run, ev), (c) => run.view.waiting(c));
        break;
      }
    } catch (e) {
      if (!run.stopped) {
        run.failed = true;
        run.view.error("The connection was lost (" + e.message + ").");
      }
    }
    S.run = null;
    const content = run.view.content;
    if (S.history.includes(message)) {  // (after "New chat" there is nothing to keep)
      if ((run.failed || run.stopped) && !content && !run.view.thinking) takeBack(message, userView, text, images);
      else S.history.push({role: "assistant", content});
    }
    run.view.done(run);
    setRunning(false);
    checkHealth();  // the header says at once whether others are waiting now
    if (!ui.dlg.open) ui.input.focus();
  }

  /* A message that got no answer leaves the conversation (so the next one is not sent after it) and, if the
     composer is empty, goes back into it to be sent again. */
  function takeBack(message, userView, text, images) {
    S.history.splice(S.history.indexOf(message), 1);
    userView.classList.add("unsent");
    if (!ui.input.value && !S.attachments.length) {
      ui.input.value = text;
      S.attachments = images;
      showAttachments();
      autosize();
    }
  }

  function stop() {
    const run = S.run;
    if (!run) return;
    run.stopped = true;
    run.ctrl.abort();
  }

  function newChat() {
    stop();
    S.history = [];
    newSession();
    S.attachments = [];
    showAttachments();
    ui.log.replaceChildren(ui.empty);
    ui.empty.hidden = false;
    ui.input.value = "";
    autosize();
    ui.input.focus();
  }

  // ---- input --------------------------------------------------------------------------------------------
  function autosize() {
    ui.input.style.height = "auto";
    ui.input.style.height = Math.min(ui.input.scrollHeight, window.innerHeight * 0.3) + "px";
  }

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  ui.input.addEventListener("input", autosize);
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && S.run && !ui.dlg.open) { e.preventDefault(); stop(); }
  });
  ui.stop.addEventListener("click", stop);
  $("new").addEventListener("click", newChat);
  ui.think.checked = store.get(THINK_ITEM, "on") !== "off";
  ui.think.addEventListener("change", () => store.set(THINK_ITEM, ui.think.checked ? "on" : "off"));
  ui.attach.addEventListener("click", () => ui.file.click());
  ui.file.addEventListener("change", () => { addFiles(ui.file.files); ui.file.value = ""; });
  ui.input.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.some((f) => f.type.startsWith("image/"))) { e.preventDefault(); addFiles(files); }
  });

  let dragDepth = 0;
  const hasFiles = (e) => e.dataTransfer && [...e.dataTransfer.types].includes("Files");
  window.addEventListener("dragenter", (e) => { if (hasFiles(e)) { dragDepth++; ui.drop.hidden = false; } });
  window.addEventListener("dragleave", () => { if (--dragDepth <= 0) { dragDepth = 0; ui.drop.hidden = true; } });
  window.addEventListener("dragover", (e) => { if (hasFiles(e)) e.preventDefault(); });
  window.addEventListener("drop", (e) => {
    if (!hasFiles(e)) return;
    e.preventDefault();
    dragDepth = 0;
    ui.drop.hidden = true;
    addFiles(e.dataTransfer.files);
  });

  newSession();
  setState("offline", "connecting…");
  poll();
  ui.input.focus();
})();
