#!/usr/bin/env bash
# GPU check (issue 11, item 5): on a CUDA machine, in one call of under 8 minutes,
#   quickstart          configs/quickstart.yaml end to end, learner on CUDA (learner.device=cuda),
#                       rollout.engine=vllm where vLLM imports with CUDA, else hf (which generates
#                       on the CPU: rollout_svc/engines/registry.py builds it with device="cpu");
#                       weight_sync.backend=auto (nccl only if every member holds CUDA weights)
#   weight_sync         benchmarks/weight_sync.py --device cuda --quick (NCCL to GPU receivers when
#                       there are GPUs for them, else gloo to CPU receivers)
#   rollout_throughput  benchmarks/rollout_throughput.py --part engines (hf vs vllm; skipped, and
#                       said so, where vllm does not import: its engines part needs vllm)
# Each step runs under `timeout`; a failed step is recorded with its log tail and the next one
# runs. Writes <out>/summary.json (every step's status, wall time, log tail on failure; the
# quickstart's start/end reward, wall time, versions, max staleness), each benchmark's JSON and
# gpu_check.log into $OUT when set (the device tool sets it), else gpu_check_out/. Exit 0 only
# when no step failed.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run       # (or GPU_CHECK_DRY=1) the same steps on CPU, tiny sizes
#   bash scripts/gpu_check.sh --fetch-wheels  # here, before: the packages the GPU image lacks, as
#                                             # cp312 wheels in .whl/ (carry it: carry=[".whl"])
#
# The GPU machine (/work/.library/device/KINDS.md): no registry reachable, a plain python3
# (3.12) holds torch with CUDA, transformers, safetensors, numpy, pyyaml, typer, rich, psutil,
# xxhash, prometheus-client, tensorboard and matplotlib, but not pyzmq, msgspec or pydantic (nor
# vllm). Missing modules are installed from .whl/ into a private folder on PYTHONPATH; Sluice
# itself runs from this checkout on PYTHONPATH (no install).
#
#   PYTHON=...            interpreter (default: python3; dry run: .venv/bin/python if present)
#   GPU_CHECK_WHEELS=dir  wheels to install from (default: .whl in the repo root)
#   GPU_CHECK_KEEP=1      keep the work folder (run directory, logs) instead of deleting it
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
# What Sluice imports that the GPU image lacks, with what they need; versions: this machine's venv.
CARRIED="pyzmq msgspec pydantic pydantic_core annotated-types typing-inspection typing_extensions"
NEEDED="torch transformers tokenizers safetensors numpy zmq msgspec pydantic yaml typer rich
prometheus_client tensorboard matplotlib xxhash psutil"

fetch_wheels() {
    local py="${PYTHON:-$ROOT/.venv/bin/python}" pins=() name version
    for name in $CARRIED; do
        version="$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")" ||
            { echo "gpu_check: $name is not installed in $py" >&2; return 1; }
        pins+=("$name==$version")
    done
    mkdir -p "$WHEELS"
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${pins[@]}" &&
        echo "gpu_check: wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1)): ${pins[*]}"
}

# record NAME STATUS RC WALL_S JSON_FILE REASON: one line of the steps table the summary reads
record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$WORK/steps.tsv"
    echo "gpu_check: $1 $2 (rc $3, ${4}s)${6:+: $6}"
}

# finish_step NAME RC T0 JSON_FILE [LIMIT_S]: append the step's log to gpu_check.log, record it.
finish_step() {
    local name=$1 rc=$2 t0=$3 json=$4 limit=${5:-} status=ok reason=""
    { echo "===== $name (rc $rc)"; cat "$WORK/$name.log"; } >>"$OUTDIR/gpu_check.log"
    if ((rc != 0)); then
        status=failed
        FAILED=1
    fi
    [[ -n "$limit" ]] && ((rc == 124 || rc == 137)) && reason="timed out after ${limit}s"
    record "$name" "$status" "$rc" "$(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}")" "$json" "$reason"
}

# run_step NAME TIMEOUT_S JSON_FILE CMD...: CMD under timeout (which signals its whole process
# group on expiry), logged to $WORK/NAME.log.
run_step() {
    local name=$1 limit=$2 json=$3 rc=0 t0
    shift 3
    echo "gpu_check: $name (timeout ${limit}s): $*"
    t0=$(date +%s.%N)
    timeout --kill-after=15 "$limit" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
    finish_step "$name" "$rc" "$t0" "$json" "$limit"
}

# setup_env: pick the interpreter, install what the image lacks from $WHEELS, check CUDA.
setup_env() {
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
    elif [[ $MODE == dry && -x "$ROOT/.venv/bin/python" ]]; then
        PY="$ROOT/.venv/bin/python"
    else
        PY=python3
    fi
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    local missing
    missing=$("$PY" -c "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if u.find_spec(m) is None])" $NEEDED) ||
        { echo "gpu_check: $PY does not run"; return 1; }
    if [[ -n "$missing" ]]; then
        echo "gpu_check: $PY lacks: $missing; installing the wheels in $WHEELS"
        compgen -G "$WHEELS/*.whl" >/dev/null ||
            { echo "gpu_check: no wheels in $WHEELS: run 'bash scripts/gpu_check.sh --fetch-wheels' first"; return 1; }
        PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$WHEELS"/*.whl || return 1
        export PYTHONPATH="$WORK/site:$PYTHONPATH"
        "$PY" -c "import $(echo $NEEDED | tr ' ' ',')" || return 1
    fi
    "$PY" - "$MODE" >"$WORK/machine.json" <<'PY' || return 1
import json, os, platform, sys
import torch
info = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count(),
        "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(), "platform": platform.platform()}
try:
    import vllm
    info["vllm"] = vllm.__version__
except Exception as e:  # recorded: the rollout engine and the engines benchmark depend on it
    info["vllm"] = None
    info["vllm_error"] = repr(e)[:300]
print(json.dumps(info))
if sys.argv[1] == "gpu" and not info["cuda_available"]:
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
PY
    cat "$WORK/machine.json"
}

machine() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]] or '')" "$WORK/machine.json" "$1"; }

run_checks() {
    local vllm gpus engine ws_args=() qs_args rt_args
    vllm=$(machine vllm)
    gpus=$(machine gpus)
    engine=hf
    [[ $MODE == gpu && -n "$vllm" ]] && engine=vllm
    if [[ $MODE == gpu ]]; then
        qs_args=(learner.device=cuda "rollout.engine=$engine")
        if ((gpus >= 2)); then  # NCCL: one GPU per rank
            ws_args=(--device cuda --quick --receivers $(for n in 1 2 4; do ((n < gpus)) && echo $n; done))
        else
            ws_args=(--device cuda --receiver-device cpu --quick --receivers 1 2 4)
        fi
        rt_args=(--part engines)
        LIMITS=(200 100 150)  # with the env step (pip from .whl: seconds) under 8 minutes
    else
        qs_args=(learner.device=cpu rollout.engine=hf learner.total_steps=6)
        ws_args=(--device cpu --quick --receivers 1 --repeats 1)
        rt_args=(--part engines --quick)
        LIMITS=(300 300 300)
    fi
    echo "$engine" >"$WORK/engine"
    run_step quickstart "${LIMITS[0]}" quickstart.json "$PY" -m sluice.cli run "$ROOT/configs/quickstart.yaml" \
        "run.dir=$WORK/quickstart" "${qs_args[@]}" --no-progress
    run_step weight_sync "${LIMITS[1]}" weight_sync.json "$PY" "$ROOT/benchmarks/weight_sync.py" "${ws_args[@]}" \
        --out "$OUTDIR/weight_sync.json"
    if [[ -n "$vllm" ]]; then
        run_step rollout_throughput "${LIMITS[2]}" rollout_throughput.json "$PY" "$ROOT/benchmarks/rollout_throughput.py" \
            "${rt_args[@]}" --out "$OUTDIR/rollout_throughput.json"
    else
        record rollout_throughput skipped "" 0 "" "vllm does not import ($(machine vllm_error)): the engines part needs it"
    fi
}

# summarize: summary.json from the steps table, the machine and the quickstart's metrics.
summarize() {
    "$PY" - "$WORK" "$OUTDIR" "$MODE" <<'PY'
import json, re, sys
from pathlib import Path

work, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
steps = []
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, rc, wall, js, reason = line.split("\t")
    step = {"name": name, "status": status, "rc": int(rc) if rc else None, "wall_s": float(wall),
            "json": js if js and (out / js).is_file() else None, "reason": reason or None}
    log = work / f"{name}.log"
    if status == "failed" and log.is_file():
        step["log_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    steps.append(step)
summary = {"mode": mode, "ok": all(s["status"] != "failed" for s in steps), "steps": steps}
machine = work / "machine.json"
summary["machine"] = json.loads(machine.read_text()) if machine.is_file() else None
metrics = work / "quickstart" / "metrics" / "learner.jsonl"
if metrics.is_file():
    recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    learner_log = (work / "quickstart" / "logs" / "learner.log").read_text(errors="replace")
    backend = re.search(r"weight sync: store .*backend (\w+)", learner_log)
    qs = {"engine": (work / "engine").read_text().strip(), "learner_device": "cuda" if mode == "gpu" else "cpu",
          "weight_sync_backend": backend.group(1) if backend else None,
          "wall_s": next(s["wall_s"] for s in steps if s["name"] == "quickstart"), "versions": None}
    if recs:
        first, last = recs[:10], recs[-10:]
        qs.update(versions=recs[-1]["version"], steps_logged=len(recs),
                  start_reward=sum(r["reward_mean"] for r in first) / len(first),
                  end_reward=sum(r["reward_mean"] for r in last) / len(last),
                  staleness_max=max(r["staleness_max"] for r in recs),
                  staleness_violations=recs[-1]["total_violations"], dropped_stale=recs[-1]["total_dropped_stale"])
    (out / "quickstart.json").write_text(json.dumps(qs, indent=2))
    summary["quickstart"] = qs
    next(s for s in steps if s["name"] == "quickstart")["json"] = "quickstart.json"
(out / "summary.json").write_text(json.dumps(summary, indent=2))
for s in steps:
    print(f"gpu_check: {s['name']:<20} {s['status']:<8} {s['wall_s']:7.1f}s  {s['reason'] or ''}")
if "quickstart" in summary:
    print("gpu_check: quickstart", json.dumps(summary["quickstart"]))
PY
}

main() {
    MODE=gpu
    case "${1:-}" in
        --fetch-wheels) fetch_wheels; return ;;
        --dry-run) MODE=dry ;;
        "") ;;
        *) echo "usage: $0 [--dry-run | --fetch-wheels]" >&2; return 2 ;;
    esac
    [[ "${GPU_CHECK_DRY:-0}" == 1 ]] && MODE=dry
    OUTDIR="${OUT:-$ROOT/gpu_check_out}"
    mkdir -p "$OUTDIR"
    OUTDIR="$(cd "$OUTDIR" && pwd)"
    rm -f "$OUTDIR"/{summary,quickstart,weight_sync,rollout_throughput}.json "$OUTDIR/gpu_check.log"
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/sluice-gpu-check-XXXXXX")"
    # the run directory and logs; what matters is copied to $OUTDIR (GPU_CHECK_KEEP=1 keeps it)
    [[ "${GPU_CHECK_KEEP:-0}" == 1 ]] || trap 'rm -rf "$WORK"' EXIT
    FAILED=0
    : >"$WORK/steps.tsv"
    local start=$SECONDS rc=0 t0
    t0=$(date +%s.%N)
    setup_env >"$WORK/env.log" 2>&1 || rc=$?  # in this shell: it sets PY and PYTHONPATH
    finish_step env "$rc" "$t0" ""
    ((rc == 0)) && run_checks
    summarize || FAILED=1
    echo "gpu_check: mode $MODE, $((SECONDS - start))s, wrote $OUTDIR"
    return $((FAILED != 0))
}

main "$@"
