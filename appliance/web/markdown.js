/* A small, safe Markdown renderer for model output.

   Safety by construction: every piece of the source is HTML-escaped before any markup is added, and the only
   markup added is a fixed set of tags from this file (p, br, h3-h6, strong, em, del, code, pre, ul, ol, li,
   blockquote, hr, table parts, a). Attributes come from a closed set: class="lang-X" (X limited to
   [A-Za-z0-9_+#.-]), start="N" (digits), style-free alignment classes, and href for http(s) links only
   (the URL was escaped with the rest of the text, so it cannot leave its quotes). Control characters are
   removed first, so the private placeholder marks (\u0001, \u0002) cannot be forged by the model.

   Covers what chat answers use: fenced code blocks (also unclosed while streaming), inline code, headings,
   bold/italic/strikethrough, bullet and numbered lists (nested by indentation), block quotes, rules,
   pipe tables, links. Everything else stays text. */
"use strict";

const Markdown = (() => {
  const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
  const TABLE_SEP = /^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$/;
  const MAX_DEPTH = 8;

  /* Inline markup on one block's text (raw; escaped here). */
  function inline(raw) {
    const keep = [];
    const hold = (html) => "\u0001" + (keep.push(html) - 1) + "\u0002";
    let s = escapeHtml(raw);
    // code spans first: their content is never touched by the other rules
    s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => hold("<code>" + code.trim() + "</code>"));
    // links: [text](http(s)://...) only; any other scheme stays text
    s = s.replace(/\[([^\]\u0001]+)\]\((https?:\/\/[^\s()\u0001]+)\)/g,
      (_, text, url) => hold('<a href="' + url + '" target="_blank" rel="noopener noreferrer">') + text + hold("</a>"));
    s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(?<![\w])__(?=\S)([\s\S]*?\S)__(?![\w])/g, "<strong>$1</strong>");
    s = s.replace(/(?<![*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?![*\w])/g, "<em>$1</em>");
    s = s.replace(/(?<![\w])_(?=[^\s_])([^_]*?[^\s_])_(?![\w])/g, "<em>$1</em>");
    s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
    return s.replace(/\u0001(\d+)\u0002/g, (_, i) => keep[+i]);
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  function splitRow(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(lines, i, out) {
    const head = splitRow(lines[i]);
    const align = splitRow(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : ""));
    const cell = (tag, text, k) => "<" + tag + (align[k] ? ' class="al-' + align[k] + '"' : "") + ">" + inline(text) + "</" + tag + ">";
    let html = "<div class=\"table\"><table><thead><tr>" + head.map((c, k) => cell("th", c, k)).join("") + "</tr></thead><tbody>";
    i += 2;
    while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
      const row = splitRow(lines[i++]);
      html += "<tr>" + head.map((_, k) => cell("td", row[k] || "", k)).join("") + "</tr>";
    }
    out.push(html + "</tbody></table></div>");
    return i;
  }

  function list(lines, i, depth, out) {
    const first = ITEM.exec(lines[i]);
    const base = first[1].length;
    const ordered = /\d/.test(first[2]);
    const items = [];
    let loose = false;
    while (i < lines.length) {
      const line = lines[i];
      const m = ITEM.exec(line);
      if (m && m[1].length <= base + 1 && /\d/.test(m[2]) === ordered && m[1].length >= base) {
        items.push({offset: m[1].length + m[2].length + 1, lines: [m[3] || ""]});
        i++;
        continue;
      }
      if (m && m[1].length < base) break;
      const item = items[items.length - 1];
      if (!line.trim()) {
        let j = i + 1;
        while (j < lines.length && !lines[j].trim()) j++;
        if (j >= lines.length) break;
        const indent = lines[j].match(/^ */)[0].length;
        const next = ITEM.exec(lines[j]);
        if (indent >= item.offset || (next && next[1].length >= base && next[1].length <= base + 1 && /\d/.test(next[2]) === ordered)) {
          loose = true;
          for (; i < j; i++) item.lines.push("");
          continue;
        }
        break;
      }
      const indent = line.match(/^ */)[0].length;
      if (indent > base) {
        item.lines.push(line.slice(Math.min(indent, item.offset)));
      } else if (!startsBlock(line) && item.lines[item.lines.length - 1].trim()) {
        item.lines.push(line.trim());  // lazy continuation of the item's paragraph
      } else {
        break;
      }
      i++;
    }
    const n = ordered ? parseInt(first[2], 10) : 1;
    let html = ordered ? (n !== 1 ? '<ol start="' + n + '">' : "<ol>") : "<ul>";
    for (const item of items) html += "<li>" + blocks(item.lines, depth + 1, !loose) + "</li>";
    out.push(html + (ordered ? "</ol>" : "</ul>"));
    return i;
  }

  /* Block structure of some lines; `tight` leaves a list item's paragraphs without <p>. */
  function blocks(lines, depth, tight) {
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const close = new RegExp("^ {0,3}" + (m[1][0] === "`" ? "`" : "~") + "{" + m[1].length + ",}[ \\t]*$");
        const lang = m[2].replace(/[^\w+#.-]/g, "").slice(0, 24);
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++;
        out.push("<pre><code" + (lang ? ' class="lang-' + lang + '"' : "") + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
        continue;
      }
      if ((m = HEADING.exec(line))) {
        const level = Math.min(6, m[1].length + 2);  // answers' # and ## stay smaller than the page's own title
        out.push("<h" + level + ">" + inline(m[2]) + "</h" + level + ">");
        i++;
        continue;
      }
      if (RULE.test(line)) { out.push("<hr>"); i++; continue; }
      if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && lines[i].trim() && (QUOTE.test(lines[i]) || !startsBlock(lines[i]))) {
          inner.push(lines[i++].replace(QUOTE, ""));
        }
        out.push("<blockquote>" + (depth < MAX_DEPTH ? blocks(inner, depth + 1, false) : "<p>" + inline(inner.join("\n")) + "</p>") + "</blockquote>");
        continue;
      }
      if (ITEM.test(line) && ITEM.exec(line)[3] !== undefined && depth < MAX_DEPTH) { i = list(lines, i, depth, out); continue; }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("|")) {
        i = table(lines, i, out);
        continue;
      }
      const para = [line];
      for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) para.push(lines[i]);
      const html = para.map((l) => inline(l.trim())).join("<br>");
      out.push(tight ? html : "<p>" + html + "</p>");
    }
    return out.join("");
  }

  function render(src) {
    const text = String(src)
      .replace(/\r\n?/g, "\n")
      .replace(/\t/g, "    ")
      .replace(/[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f]/g, "");
    return blocks(text.split("\n"), 0, false);
  }

  return {render, escapeHtml};
})();
