/* Server-Sent Events over fetch: EventSource cannot POST, so the chat stream is read with fetch and parsed here.
   Follows the WHATWG event-stream rules: lines end in CR, LF or CRLF (a CR at the end of a chunk waits for the
   next one), a blank line dispatches the event, `data` lines join with "\n", a line starting with ':' is a
   comment (our server sends `: queued` / `: prefill` while a request waits), one space after the colon is
   dropped, unknown fields are ignored. */
"use strict";

class SSEParser {
  constructor(onEvent, onComment) {
    this.onEvent = onEvent;           // ({event, data}) for each dispatched event
    this.onComment = onComment || (() => {});
    this.buf = "";
    this.data = [];
    this.event = "";
  }

  push(text) {
    this.buf += text;
    let start = 0;
    for (let i = 0; i < this.buf.length; i++) {
      const ch = this.buf.charCodeAt(i);
      if (ch !== 10 && ch !== 13) continue;
      if (ch === 13 && i === this.buf.length - 1) break;    // a CR that may be half of a CRLF
      this.line(this.buf.slice(start, i));
      if (ch === 13 && this.buf.charCodeAt(i + 1) === 10) i++;
      start = i + 1;
    }
    this.buf = this.buf.slice(start);
  }

  line(line) {
    if (line === "") {
      if (this.data.length) this.onEvent({event: this.event || "message", data: this.data.join("\n")});
      this.data = [];
      this.event = "";
      return;
    }
    if (line.charCodeAt(0) === 58) {  // ':'
      this.onComment(line.slice(1).replace(/^ /, ""));
      return;
    }
    const c = line.indexOf(":");
    const field = c < 0 ? line : line.slice(0, c);
    let value = c < 0 ? "" : line.slice(c + 1);
    if (value.charCodeAt(0) === 32) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
  }
}

/* Read a fetch Response body as SSE: calls onEvent/onComment as bytes arrive; resolves at the end of the body. */
async function readSSE(response, onEvent, onComment) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");
  const parser = new SSEParser(onEvent, onComment);
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    parser.push(decoder.decode(value, {stream: true}));
  }
  parser.push(decoder.decode());  // an event without its blank line at the end is dropped, as EventSource does
}
