"""A local stand-in for an SGLang server, for the sglang backend's error paths only (answers a real SGLang
server does not give on demand: another client changing its weight version, a refused folder, a model that
does not generate). The backend's behaviour is tested against a real SGLang server: tests/integration/
test_sglang_server.py (make test-sglang).

It serves the routes and JSON shapes of SGLang's native HTTP API as found in sgl-project/sglang:
``python/sglang/srt/entrypoints/http_server.py`` (routes ``/generate``, ``/update_weights_from_disk``
answering ``{"success", "message", "num_paused_requests"}`` with 400 on failure, ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, ``/get_model_info`` and ``/model_info``,
``/update_weight_version``) and
``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``: ``input_ids`` one list or a batch,
``sampling_params`` with ``temperature``/``max_new_tokens``/``stop_token_ids``, ``return_logprob``;
``UpdateWeightFromDiskReqInput``: ``model_path``, ``weight_version``, ``flush_cache``). Each answer
has ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` as ``[logprob, token_id, None]``,
``finish_reason`` ``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``,
``prompt_tokens``, ``completion_tokens`` and ``weight_version``. Like SGLang's sampler, the log-probs
are log_softmax(logits / temperature), before top-k/top-p filtering.

The model is real (transformers, through Relay's torch backend); only the server is a stand-in.
Every request is appended to ``--log`` as one JSON line so tests can check what the client sent.

    python tests/support/sglang_mock_server.py --model DIR --port N [--log FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from generators.config import SamplingConfig, TorchBackendConfig
from generators.backends.torch import TorchBackend


class State:
    def __init__(self, model: str, log_path: str | None, embedding: bool = False):
        self.engine = TorchBackend(TorchBackendConfig())
        self.engine.load(model)
        self.model_path = model
        self.weight_version = "default"
        self.paused = False
        self.lock = threading.Lock()
        self.log_path = log_path
        self.seed = 0
        self.embedding = embedding  # /model_info says is_generation false
        self.architectures = json.loads((Path(model) / "config.json").read_text())["architectures"]

    def log(self, route: str, body: dict) -> None:
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"route": route, "body": body}) + "\n")


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path in ("/get_model_info", "/model_info"):
                self._reply(
                    200,
                    {
                        "model_path": state.model_path,
                        "tokenizer_path": state.model_path,
                        "is_generation": not state.embedding,
                        "weight_version": state.weight_version,
                        "architectures": state.architectures,
                    },
                )
            elif self.path == "/health":
                self._reply(200, {})
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            state.log(self.path, body)
            if self.path == "/generate":
                self._generate(body)
            elif self.path == "/update_weights_from_disk":
                with state.lock:
                    try:
                        state.engine.update_weights(body["model_path"])
                    except (OSError, ValueError, KeyError) as e:
                        self._reply(
                            HTTPStatus.BAD_REQUEST,
                            {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0},
                        )
                        return
                    state.model_path = body["model_path"]
                    if body.get("weight_version") is not None:
                        state.weight_version = body["weight_version"]
                self._reply(
                    200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
                )
            elif self.path == "/update_weight_version":  # another client relabels the served weights
                state.weight_version = body["new_version"]
                self._reply(200, {"success": True, "message": "ok"})
            elif self.path in ("/flush_cache", "/pause_generation", "/continue_generation"):
                state.paused = self.path == "/pause_generation" or (state.paused and self.path == "/flush_cache")
                self._reply(200, {})
            else:
                self._reply(404, {"detail": "Not Found"})

        def _generate(self, body: dict) -> None:
            ids = body["input_ids"]
            single = bool(ids) and isinstance(ids[0], int)
            rows = [ids] if single else ids
            sp = body.get("sampling_params") or {}
            temperature = sp.get("temperature", 1.0)
            sampling = SamplingConfig(
                n=1,
                temperature=temperature or 1.0,
                top_k=0 if temperature else 1,  # 0 = greedy
                max_tokens=sp.get("max_new_tokens", 128),
            )
            with state.lock:
                state.seed += 1
                out = state.engine.generate(rows, sampling, seed=state.seed)
                version = state.weight_version
            answers = []
            for prompt, (c,) in zip(rows, out):
                meta = {
                    "id": f"req-{state.seed}",
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(c.token_ids),
                    "weight_version": version,
                    "finish_reason": (
                        {"type": "stop", "matched": c.token_ids[-1]}
                        if c.finish_reason == "stop"
                        else {"type": "length", "length": len(c.token_ids)}
                    ),
                }
                if body.get("return_logprob"):
                    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
                answers.append({"text": state.engine.decode(c.token_ids), "output_ids": c.token_ids, "meta_info": meta})
            self._reply(200, answers[0] if single else answers)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log")
    p.add_argument("--embedding", action="store_true", help="serve as a model that does not generate")
    a = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(State(a.model, a.log, a.embedding)))
    server.serve_forever()


if __name__ == "__main__":
    main()
