// A remote environment written from docs/agents.md alone, in Node with its standard library only:
// what a user of another stack would write. Tests run it as a separate process.
//
//     node tests/support/remote_env_server.js --port 9100 [--token-env NAME]
//
// The environment is calc-like: the prompt is "A*B=" (or + -), the model calls the calculator
// (<tool_call>EXPR</tool_call>, or the Hermes JSON form), the server replies with the result (role
// "tool"); a turn without a call is the answer: done, reward 1 when it equals the reference, else 0.
// Test controls (not part of the contract):
//   POST /control  {"mode": "ok" | "500" | "hang" | "garbage"} changes how /reset, /step and /close answer
//   GET  /stats    {"mode", "requests", "resets", "steps", "closes", "open_episodes", "unauthorized"}
"use strict";
const http = require("http");

const args = process.argv.slice(2);
const arg = (name, dflt) => (args.indexOf(name) >= 0 ? args[args.indexOf(name) + 1] : dflt);
const port = Number(arg("--port", "9100"));
const token = arg("--token-env", "") ? process.env[arg("--token-env", "")] || "" : "";

const state = { mode: "ok", requests: 0, resets: 0, steps: 0, closes: 0, unauthorized: 0 };
const episodes = new Map(); // episode_id -> {reference, answers: Map(index -> reply)}

function calc(expr) {
  const m = /^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$/.exec(expr);
  if (!m) return null;
  const a = BigInt(m[1]), b = BigInt(m[3]);
  return String(m[2] === "+" ? a + b : m[2] === "-" ? a - b : a * b);
}

function step(ep, turn) {
  const m = /<tool_call>([\s\S]*?)<\/tool_call>/.exec(turn);
  if (!m) {
    const reward = turn.trim() === ep.reference ? 1.0 : 0.0;
    return { reply: null, done: true, role: "tool", reward, tool_calls: [], info: { turns: ep.turns + 1 } };
  }
  let expr = m[1].trim();
  if (expr.startsWith("{")) {
    try { expr = String(JSON.parse(expr).arguments.expression); } catch (e) { expr = ""; }
  }
  const value = calc(expr);
  const call = value === null ? { name: "calculator", ok: false, error: "bad_expression" }
                              : { name: "calculator", ok: true, error: "" };
  return { reply: value === null ? "error: bad_expression" : value, done: false, role: "tool", reward: null,
           tool_calls: [call], info: {} };
}

function send(res, code, body, type = "application/json") {
  const data = Buffer.from(typeof body === "string" ? body : JSON.stringify(body));
  res.writeHead(code, { "Content-Type": type, "Content-Length": data.length });
  res.end(data);
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    if (req.method === "GET" && req.url === "/stats") {
      return send(res, 200, { ...state, open_episodes: episodes.size });
    }
    let body;
    try { body = JSON.parse(Buffer.concat(chunks).toString() || "{}"); } catch (e) { return send(res, 400, { detail: "not JSON" }); }
    if (req.url === "/control") { state.mode = body.mode; return send(res, 200, {}); }
    if (token && req.headers.authorization !== `Bearer ${token}`) {
      state.unauthorized++;
      return send(res, 401, { detail: "bad token" });
    }
    state.requests++;
    if (state.mode === "500") return send(res, 500, "internal error", "text/plain");
    if (state.mode === "hang") return; // never answers (the client's timeout must fire)
    if (state.mode === "garbage") return send(res, 200, "<html>not json</html>", "text/html");
    if (req.url === "/close") {
      state.closes++;
      episodes.delete(body.episode_id);
      return send(res, 200, {});
    }
    if (req.url === "/reset") {
      state.resets++;
      episodes.set(body.episode_id, { reference: String(body.prompt.reference).trim(), turns: 0, answers: new Map() });
      return send(res, 200, { ok: true });
    }
    if (req.url === "/step") {
      const ep = episodes.get(body.episode_id);
      if (!ep) return send(res, 404, { detail: "unknown episode" });
      if (ep.answers.has(body.index)) return send(res, 200, ep.answers.get(body.index)); // a retried step
      state.steps++;
      const reply = step(ep, String(body.turn));
      ep.turns++;
      ep.answers.set(body.index, reply);
      return send(res, 200, reply);
    }
    send(res, 404, { detail: "not found" });
  });
});

server.listen(port, "127.0.0.1");
process.on("SIGTERM", () => process.exit(0));
