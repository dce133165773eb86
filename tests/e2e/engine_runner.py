#!/usr/bin/env python3
"""Run one offline vLLM engine for kvbridge's end-to-end tests and benchmarks.

    python engine_runner.py SPEC.json

SPEC is a JSON object (the harness in ``e2e_harness.py`` writes it):

    role            "baseline" | "prefill" | "decode"
    model           path of a local checkpoint
    out             where the final result JSON goes (written atomically)
    prompts         list of token-id lists
    max_tokens      tokens to generate (baseline, decode); prefill always uses 1
    rounds          how many times the prompt batch runs (default 1)
    exchange_dir    prefill/decode: folder for the round hand-over files below
    kv_transfer_config
                    keyword arguments of vLLM's KVTransferConfig (prefill, decode)
    engine          extra keyword arguments for ``vllm.LLM`` (tensor_parallel_size,
                    load_format, kv_cache_memory_bytes, ...)
    wait_timeout_s  longest wait for the other side's file in a round (default 600)
    gate            decode: also wait for gate_r{r} (written by the harness) before
                    using round r's parameters
    push            push mode (kvbridge): both engines get the request at once, with a
                    shared transfer id "{push_prefix}-r{r}-{i}"; decode: {"host", "port"}
                    of the prefill side channel; prefill: {}. Each engine waits for the
                    other's ``.ready`` file before round 0
    flush_after_release
                    prefill: after the last round, run one tiny local request so the
                    workers' finished sends and connector stats reach the metrics

Each engine touches ``{role}.ready`` in exchange_dir once it has started.

Round protocol (r = 0, 1, ...), so that prefill stays alive until decode pulled:
    prefill: generate 1 token with {"do_remote_decode": true}
             -> write prefill_r{r}.json, then wait for decode_r{r}.done
    decode:  wait for prefill_r{r}.json, generate with those kv_transfer_params
             -> write decode_r{r}.json, touch decode_r{r}.done
Either side gives up when an ``abort`` file appears in exchange_dir (the harness
writes it when the other side died) or a wait passes wait_timeout_s.

Per round the result holds, per prompt, the generated token ids, finish reason,
the returned kv_transfer_params and request timings, plus the engine's metrics
(``llm.get_metrics()``) after the round. A non-zero exit means failure.

Long-lived mode, for tests that reuse one engine across scenarios:

    python engine_runner.py --serve INIT.json

INIT holds ``model``, ``engine``, ``kv_transfer_config`` (optional: without it the
engine runs no connector) and ``ctrl_dir``. Once the engine is up the runner writes
``ctrl_dir/ready.json`` (start and import seconds, pid, metrics), then reads one JSON
command per line on stdin and answers each in ``ctrl_dir/reply_{seq}.json``:

    {"seq": n, "op": "generate", "prompts": [...], "max_tokens": m,
     "params": [kv_transfer_params or null per prompt]}
        -> outputs (as in a round above), generate_s, metrics after
    {"seq": n, "op": "metrics"}            -> metrics
    {"seq": n, "op": "flush", "prompt": [...], "delay_s": 1.0}
        -> after the delay one local 1-token request (finished sends and connector
           stats reach the metrics), then metrics
    {"seq": n, "op": "exit"}               -> replies, then exits 0

A command that raises is answered with ``error`` and ``traceback``; the engine
keeps serving. End of stdin ends the runner. The runner knows nothing about
connectors: every kv_transfer_params dict comes from the harness.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


class Aborted(RuntimeError):
    """The harness asked this engine to stop (the other side failed)."""


def _log(msg: str) -> None:
    print(f"[engine_runner pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _metrics_snapshot(llm: Any) -> list[dict[str, Any]]:
    """``llm.get_metrics()`` (Counter/Gauge/Histogram/Vector) as JSON-ready dicts."""
    out = []
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001 - metrics are diagnostics
        _log(f"get_metrics failed: {e!r}")
        return out
    for m in metrics:
        item: dict[str, Any] = {"name": m.name, "type": type(m).__name__, "labels": dict(m.labels)}
        for attr in ("value", "count", "sum", "values"):
            if hasattr(m, attr):
                item[attr] = getattr(m, attr)
        if hasattr(m, "buckets"):
            item["buckets"] = {str(k): v for k, v in m.buckets.items()}
        out.append(item)
    return out


def _request_metrics(output: Any) -> dict[str, Any] | None:
    m = getattr(output, "metrics", None)
    if m is None:
        return None
    keys = (
        "arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts",
        "first_token_latency", "num_generation_tokens", "num_preemptions",
    )
    return {k: getattr(m, k) for k in keys if hasattr(m, k)}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=repr))
    os.replace(tmp, path)


def _set_session_nice(nice: int) -> None:
    """Set the scheduling weight of this engine's whole session (its autogroup).

    An engine that merely waits still burns CPU: its engine loop keeps stepping
    while it holds blocks for a peer, and NIXL progress threads spin. On a
    two-core machine that starved a starting engine for minutes (long enough
    for the prefill lease to lapse), so a waiting engine gives way. Each engine
    is its own session, hence its own autogroup: per-process nice values would
    not count across sessions. Best effort: without permission it only logs.
    """
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError as e:
        _log(f"could not set autogroup nice {nice}: {e}")


def _wait_for(path: Path, exchange: Path, timeout_s: float, what: str, *,
              yield_cpu: bool = False) -> None:
    """Wait for ``path`` (bounded; aborts on the harness's ``abort`` file).

    With ``yield_cpu`` this engine's session runs at the lowest priority while it
    waits. Only decode does that: a prefill engine that waits is holding blocks
    and must keep serving reads (on this host a NIXL READ completes only when the
    target makes progress) and handshakes (vLLM's NixlConnector gives up after 5 s).
    """
    if path.exists():
        return
    deadline = time.monotonic() + timeout_s
    if yield_cpu:
        _set_session_nice(19)
    try:
        while not path.exists():
            if (exchange / "abort").exists():
                raise Aborted(f"abort requested while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} ({path}) did not appear within {timeout_s:.0f} s")
            time.sleep(0.02)
    finally:
        if yield_cpu:
            _set_session_nice(0)


def _engine_kwargs(spec: dict[str, Any], *, need_connector: bool) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: the CPU defaults the tests need, then ``engine``."""
    engine_kwargs: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        kv_cache_memory_bytes=64 * 2**20,
        enforce_eager=True,
        max_model_len=1024,
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
    )
    engine_kwargs.update(spec.get("engine") or {})
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:
        engine_kwargs.setdefault("distributed_executor_backend", "mp")
    kv_cfg = spec.get("kv_transfer_config")
    if need_connector and not kv_cfg:
        raise ValueError(f"role {spec.get('role')} needs kv_transfer_config")
    if kv_cfg:
        from vllm.config import KVTransferConfig

        engine_kwargs["kv_transfer_config"] = KVTransferConfig(**kv_cfg)
    return engine_kwargs


def _output_record(o: Any) -> dict[str, Any]:
    return {
        "request_id": o.request_id,
        "token_ids": list(o.outputs[0].token_ids) if o.outputs else [],
        "finish_reason": o.outputs[0].finish_reason if o.outputs else None,
        "kv_transfer_params": o.kv_transfer_params,
        "metrics": _request_metrics(o),
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    role = spec["role"]
    if role not in ("baseline", "prefill", "decode"):
        raise ValueError(f"role must be baseline, prefill or decode, got {role!r}")
    prompts: list[list[int]] = spec["prompts"]
    if not prompts or not all(prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    rounds = int(spec.get("rounds", 1))
    wait_timeout = float(spec.get("wait_timeout_s", 600))
    exchange = Path(spec["exchange_dir"]) if role != "baseline" else None

    t_import = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t_import
    engine_kwargs = _engine_kwargs(spec, need_connector=role != "baseline")

    _log(f"starting {role} engine with {sorted(engine_kwargs)}")
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    start_s = time.perf_counter() - t0
    _log(f"engine ready in {start_s:.1f} s")
    if exchange is not None:
        (exchange / f"{role}.ready").touch()
    push = spec.get("push")
    if push is not None:
        assert exchange is not None
        other = "decode" if role == "prefill" else "prefill"
        _wait_for(exchange / f"{other}.ready", exchange, wait_timeout, f"{other} engine start",
                  yield_cpu=role == "decode")

    def push_params(r: int, i: int) -> dict[str, Any]:
        tid = f"{spec.get('push_prefix', 'kvb')}-r{r}-{i}"
        if role == "prefill":
            return {"do_remote_decode": True, "transfer_mode": "push", "kvbridge_transfer_id": tid}
        return {"do_remote_prefill": True, "transfer_mode": "push", "kvbridge_transfer_id": tid,
                "remote_host": push["host"], "remote_port": int(push["port"])}

    max_tokens = 1 if role == "prefill" else int(spec["max_tokens"])

    def sampling(params: dict[str, Any] | None) -> Any:
        extra = {"kv_transfer_params": dict(params)} if params is not None else None
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
            extra_args=extra,
        )

    result: dict[str, Any] = {
        "role": role,
        "pid": os.getpid(),
        "import_s": import_s,
        "engine_start_s": start_s,
        "metrics_start": _metrics_snapshot(llm),
        "rounds": [],
    }
    for r in range(rounds):
        waited_s = 0.0
        if push is not None and role != "baseline":
            params: list[dict[str, Any] | None] = [push_params(r, i) for i in range(len(prompts))]
        elif role == "prefill":
            params = [{"do_remote_decode": True} for _ in prompts]
        elif role == "decode":
            assert exchange is not None
            src = exchange / f"prefill_r{r}.json"
            t_wait = time.perf_counter()
            _wait_for(src, exchange, wait_timeout, f"prefill round {r}", yield_cpu=True)
            if spec.get("gate"):
                # The harness opens the gate once it has done what the test needs
                # between publication and pull (e.g. killed the prefill engine).
                _wait_for(exchange / f"gate_r{r}", exchange, wait_timeout, f"gate of round {r}",
                          yield_cpu=True)
            waited_s = time.perf_counter() - t_wait
            params = [o["kv_transfer_params"] for o in json.loads(src.read_text())["outputs"]]
            if len(params) != len(prompts) or not all(params):
                raise ValueError(f"round {r}: prefill returned kv_transfer_params {params!r}")
        else:
            params = [None] * len(prompts)

        t1 = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [sampling(p) for p in params],
            use_tqdm=False,
        )
        generate_s = time.perf_counter() - t1
        _log(f"round {r}: generate took {generate_s * 1e3:.1f} ms")
        rec: dict[str, Any] = {
            "round": r,
            "generate_s": generate_s,
            "outputs": [_output_record(o) for o in outputs],
        }
        if role == "decode":
            rec["waited_for_prefill_s"] = waited_s
        rec["metrics"] = _metrics_snapshot(llm)
        result["rounds"].append(rec)

        if role == "prefill":
            assert exchange is not None
            _write_json(exchange / f"prefill_r{r}.json", rec)
            t_hold = time.perf_counter()
            _wait_for(exchange / f"decode_r{r}.done", exchange, wait_timeout, f"decode round {r}")
            rec["held_s"] = time.perf_counter() - t_hold
        elif role == "decode":
            assert exchange is not None
            _write_json(exchange / f"decode_r{r}.json", rec)
            (exchange / f"decode_r{r}.done").touch()

    if role == "prefill" and spec.get("flush_after_release", True):
        # Let the workers see decode's completion notifications, then run one local
        # step so finished sends and connector stats reach the scheduler's metrics.
        time.sleep(float(spec.get("flush_delay_s", 1.0)))
        flush = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:8])], flush, use_tqdm=False)
    result["metrics_end"] = _metrics_snapshot(llm)
    _write_json(Path(spec["out"]), result)
    _log(f"wrote {spec['out']}")
    return result


def serve(init: dict[str, Any]) -> int:
    """Long-lived engine: answer commands from stdin until ``exit`` or end of input."""
    import traceback

    ctrl = Path(init["ctrl_dir"])
    t_import = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t_import
    engine_kwargs = _engine_kwargs(init, need_connector=False)
    _log(f"starting long-lived engine {init.get('name')} with {sorted(engine_kwargs)}")
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    start_s = time.perf_counter() - t0
    _log(f"engine ready in {start_s:.1f} s")
    _write_json(ctrl / "ready.json", {"pid": os.getpid(), "import_s": import_s,
                                      "engine_start_s": start_s, "metrics": _metrics_snapshot(llm)})

    def generate(prompts: list[list[int]], max_tokens: int,
                 params: list[dict[str, Any] | None]) -> tuple[list[Any], float]:
        sps = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False,
                              extra_args={"kv_transfer_params": dict(p)} if p else None)
               for p in params]
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        return outs, time.perf_counter() - t1

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        seq, op = int(cmd["seq"]), cmd.get("op")
        reply: dict[str, Any] = {"seq": seq, "op": op}
        try:
            if op == "generate":
                prompts = cmd["prompts"]
                params = cmd.get("params") or [None] * len(prompts)
                if not prompts or len(params) != len(prompts):
                    raise ValueError("generate needs prompts and one params entry per prompt")
                outs, gen_s = generate(prompts, int(cmd["max_tokens"]), params)
                _log(f"command {seq}: generate of {len(prompts)} took {gen_s * 1e3:.1f} ms")
                reply.update(generate_s=gen_s, outputs=[_output_record(o) for o in outs])
            elif op == "flush":
                time.sleep(float(cmd.get("delay_s", 1.0)))
                generate([cmd["prompt"]], 1, [None])
            elif op not in ("metrics", "exit"):
                raise ValueError(f"unknown op {op!r}")
            reply["metrics"] = _metrics_snapshot(llm)
        except Exception as e:  # noqa: BLE001 - reported to the harness, which raises
            reply.update(error=repr(e), traceback=traceback.format_exc())
            _log(f"command {seq} failed: {e!r}")
        _write_json(ctrl / f"reply_{seq}.json", reply)
        if op == "exit":
            break
    _log("serve loop ended")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--serve":
        return serve(json.loads(Path(argv[2]).read_text()))
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    try:
        run(spec)
    except Aborted as e:
        _log(f"aborted: {e}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
