// The chat page of `minillm serve` (chapter 12): no framework, no CDN, only this server's OpenAI API.
// Each question sends the whole conversation to /v1/chat/completions with stream: true and reads the
// server-sent events as they come; Stop aborts the fetch, which closes the connection, and the server
// aborts the request (its KV blocks go back to the pool before the next engine step).
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of every turn so far: what the model sees
let controller = null;  // the AbortController of the answer being streamed, if any

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

async function showModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    $("model").textContent = r.ok ? body.data[0].id : `(${body.error?.message ?? r.status})`;
  } catch (e) {
    $("model").textContent = `(server unreachable: ${e.message})`;
  }
}

// Server-sent events: blocks separated by a blank line; a block's `data:` lines joined by "\n".
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, cut).split("\n");
      buffer = buffer.slice(cut + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function showStats(s) {
  // tokens/s over the decode: (tokens - 1) / (last text - first text), as 1 / TPOT
  const rate = s.tokens > 1 && s.last > s.first ? (s.tokens - 1) / ((s.last - s.first) / 1000) : null;
  const ttft = s.first !== null ? s.first - s.start : null;
  const stats = $("stats");
  stats.dataset.ttftMs = ttft === null ? "" : ttft.toFixed(1);
  stats.dataset.tokensPerS = rate === null ? "" : rate.toFixed(2);
  stats.dataset.tokens = String(s.tokens);
  stats.dataset.finish = s.finish ?? "";
  stats.textContent = `last answer: TTFT ${ttft === null ? "–" : ttft.toFixed(0) + " ms"} · ` +
    `${rate === null ? "–" : rate.toFixed(1)} tokens/s · ${s.tokens} tokens · ${s.finish ?? "?"}`;
}

async function ask(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  answer.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  const body = {
    messages: conversation, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if ($("ignore-eos").checked) body.ignore_eos = true;
  const s = { start: performance.now(), first: null, last: null, tokens: 0, finish: null };
  let reply = "", usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error(e.error?.message ?? `HTTP ${r.status}`);
    }
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage.completion_tokens;
      for (const choice of event.choices ?? []) {
        const piece = choice.delta?.content;
        if (piece) {
          s.last = performance.now();
          s.first ??= s.last;
          s.tokens += 1;  // a chunk; the usage chunk, when it comes, gives the exact count
          reply += piece;
          answer.textContent = reply;
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (choice.finish_reason) s.finish = choice.finish_reason;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      s.finish = "stopped";
    } else {
      s.finish = "error";
      addMessage("error", e.message);
    }
  } finally {
    controller = null;
    answer.classList.remove("streaming");
    setBusy(false);
  }
  if (usage !== null) s.tokens = usage;
  conversation.push({ role: "assistant", content: reply });
  showStats(s);
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  ask(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  controller?.abort();
  conversation.length = 0;
  $("log").replaceChildren();
  $("stats").textContent = "no answer yet";
});
$("api-key").addEventListener("change", showModel);
showModel();
