#!/usr/bin/env bash
# powerflex's read-only path on a GPU (issue 23, item 5): runs powerflexd in observe mode
# (agent.enforce = false) against this machine's libnvidia-ml.so.1 beside a short training
# loop that reports progress through agent/python/powerflex_progress.py, then prints what
# the agent saw next to what nvidia-smi and nvidia-ml-py (pynvml) report: GPU name, limits
# and constraints, power, the energy counter's advance, clock-event reasons, the training
# process in NVML's process list, and the job's energy record.
#
# It NEVER writes a power limit or any other GPU setting. The agent runs from a site config
# this script writes into its own private temporary directory (never a site's /etc config)
# and reads back before starting it: anything but `enforce = false` there, or an agent
# whose status says it enforces, and it refuses. Its own NVML and nvidia-smi calls are
# reads. Every GPU's limit is read before the agent starts, during the run and after the
# agent stopped; any change fails the run loudly.
#
#   scripts/gpu-observe.sh [--seconds N] [--gpu I] [--nvml PATH] [--bin-dir DIR] [--user NAME]
#                          [--flex SPEC] [--sample-interval-ms MS] [--out DIR] [--job-python PY]
#
#   --seconds N      training time between the start and end samples (default 120)
#   --gpu I          the NVML index of the GPU the job gets (default 0)
#   --nvml PATH      the NVML library to load (default: libnvidia-ml.so.1 as ldconfig finds it)
#   --bin-dir DIR    where powerflexd is (default target/release; build with
#                    `cargo build --release -p powerflex-agent`)
#   --user NAME      run the training loop as this user (default: root), as Slurm runs a job
#   --flex SPEC      the job's --power-flex value (default flex1,calibrate=off)
#   --out DIR        copy the readings, the agent's log and the report there
#   --job-python PY  the training loop's interpreter (default: python3 on PATH)
#
# Run as root: registering a job on the agent's control socket is root's (slurmstepd's),
# and the agent attributes a process to a job only through a root-owned `slurmstepd`
# ancestor. Without Slurm the job's step daemon is a stand-in: a copy of /bin/sh named
# `slurmstepd`, titled `slurmstepd: [JOB.0]`, under which the training loop runs (the
# agent's own tests do the same). Needs python3 with pynvml (`pip install nvidia-ml-py`);
# PyTorch is optional: without it, or without CUDA, a CPU-only stand-in reports progress
# and is labelled as such.
#
# Against the SIMULATED library (`--nvml target/debug/libpowerflex_sim_nvml.so` with
# POWERFLEX_SIM_DIR naming a node `powerflex-sim init` made) the GPU work is
# `powerflex-simjob` from --bin-dir, run in the job beside the CPU stand-in, and every
# figure is labelled SIMULATED. tests/gpu_observe.rs runs it that way.
#
# Test only: GPU_OBSERVE_TEST_WRITE_ENFORCE=1 makes the config writer write
# `enforce = true`, to prove the check refuses it before any agent starts.
#
# Exit codes: 0 the agent and NVML agree within the stated tolerances and no limit changed;
# 1 a check failed (each named: a disagreement, a changed limit); 2 refused or could not
# run (observe mode off, not root, no NVML, no pynvml, the agent would not start).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

seconds=120
gpu=0
nvml=""
bin_dir="$repo/target/release"
user=""
flex="flex1,calibrate=off"
interval_ms=500
out=""
job_python=""

say() { printf 'gpu-observe: %s\n' "$*"; }
refuse() {
    printf 'gpu-observe: %s\n' "$*" >&2
    exit 2
}
usage() {
    sed -n '16,30p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case $1 in
    --seconds) seconds=${2:?}; shift 2 ;;
    --gpu) gpu=${2:?}; shift 2 ;;
    --nvml) nvml=${2:?}; shift 2 ;;
    --bin-dir) bin_dir=${2:?}; shift 2 ;;
    --user) user=${2:?}; shift 2 ;;
    --flex) flex=${2:?}; shift 2 ;;
    --sample-interval-ms) interval_ms=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --job-python) job_python=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    *) printf 'gpu-observe: unknown argument %q\n' "$1" >&2; usage ;;
    esac
done
[[ $seconds =~ ^[0-9]+$ ]] && [ "$seconds" -ge 5 ] && [ "$seconds" -le 3600 ] ||
    refuse "--seconds must be a whole number from 5 to 3600, not '$seconds'"
[[ $gpu =~ ^[0-9]+$ ]] || refuse "--gpu must be an NVML index (0, 1, ...), not '$gpu'"
[[ $interval_ms =~ ^[0-9]+$ ]] && [ "$interval_ms" -ge 50 ] && [ "$interval_ms" -le 5000 ] ||
    refuse "--sample-interval-ms must be from 50 to 5000, not '$interval_ms'"

# --- what it needs --------------------------------------------------------------------
[ "$(id -u)" = 0 ] || refuse "run as root: registering a job on powerflexd's control socket is root's (slurmstepd's), and the agent finds a job's processes only under a root-owned step daemon"
command -v python3 >/dev/null || refuse "python3 not found"
python3 -c 'import pynvml' 2>/dev/null ||
    refuse "python3 cannot import pynvml: install nvidia-ml-py (python3 -m pip install nvidia-ml-py)"
[ -d "$bin_dir" ] || refuse "no directory $bin_dir (--bin-dir)"
bin_dir=$(cd "$bin_dir" && pwd) # the job's step runs from /
agent_bin="$bin_dir/powerflexd"
[ -x "$agent_bin" ] || refuse "no powerflexd at $agent_bin: build it (cargo build --release -p powerflex-agent) or pass --bin-dir"
if [ -z "$nvml" ]; then
    nvml=$(ldconfig -p 2>/dev/null | awk '/libnvidia-ml\.so\.1 / && /x86-64|aarch64|64bit/ {print $NF; exit}')
    if [ -z "$nvml" ]; then
        for candidate in /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 /usr/lib64/libnvidia-ml.so.1 \
            /usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1 /usr/lib/wsl/lib/libnvidia-ml.so.1; do
            [ -e "$candidate" ] && nvml=$candidate && break
        done
    fi
    [ -n "$nvml" ] || refuse "libnvidia-ml.so.1 not found (ldconfig -p, /usr/lib*); pass --nvml PATH"
fi
[ -e "$nvml" ] || refuse "no NVML library at $nvml"
nvml=$(readlink -f "$nvml")
train_uid=0
train_gid=0
as_user=()
if [ -n "$user" ]; then
    train_uid=$(id -u "$user" 2>/dev/null) || refuse "no user '$user'"
    train_gid=$(id -g "$user")
    as_user=(setpriv "--reuid=$train_uid" "--regid=$train_gid" --clear-groups)
fi
# The training loop's interpreter: python3 as this shell finds it (a venv's, with its
# torch), unless the job's user cannot run that one (root's pyenv under /root). Tried
# through env, as the job runs it: setpriv itself still reaches a path the user cannot.
if [ -z "$job_python" ]; then
    job_python=$(python3 -c 'import sys; print(sys.executable)')
    if ! "${as_user[@]}" env "$job_python" -c '' 2>/dev/null; then
        say "$user cannot run $job_python; the training loop uses /usr/bin/python3 (--job-python to choose)"
        job_python=/usr/bin/python3
    fi
fi
"${as_user[@]}" env "$job_python" -c '' 2>/dev/null || refuse "${user:-root} cannot run $job_python; pass --job-python PATH"

# --- a private work directory; everything this script started is stopped by PID --------
work=$(mktemp -d /tmp/pf-gpu-observe.XXXXXX)
# Others may pass through (the job's user reaches the progress socket) but not list it;
# the config, the state and the readings are root's alone.
chmod 0711 "$work"
mkdir -m 0700 "$work/readings" "$work/state" "$work/lib" "$work/bin"
mkdir -m 0755 "$work/run" "$work/job"
ln -s "$nvml" "$work/lib/libnvidia-ml.so.1"
cp "$repo/agent/python/powerflex_progress.py" "$repo/scripts/gpu_observe_train.py" "$work/job/"
chmod 0644 "$work/job/"*.py
R=$work/readings
agent_pid=""
stepd_pid=""

# The processes under the stand-in step daemon (the job's), by walking /proc from its PID.
job_pids() {
    [ -n "$stepd_pid" ] || return 0
    python3 "$repo/scripts/gpu_observe.py" tree "$stepd_pid"
}
cleanup() {
    local rc=$? pid
    if [ -n "$stepd_pid" ] && kill -0 "$stepd_pid" 2>/dev/null; then
        for pid in $(job_pids); do kill -TERM "$pid" 2>/dev/null || true; done
        kill -TERM "$stepd_pid" 2>/dev/null || true
        wait "$stepd_pid" 2>/dev/null || true
    fi
    if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
        kill -TERM "$agent_pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$agent_pid" 2>/dev/null || true
        wait "$agent_pid" 2>/dev/null || true
    fi
    if [ -n "$out" ]; then
        mkdir -p "$out"
        cp -r "$R/." "$out/" 2>/dev/null || true
        cp "$work/agent.log" "$work/job/"*.out "$work/job/"*.err "$out/" 2>/dev/null || true
    fi
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

py() { python3 "$repo/scripts/gpu_observe.py" "$@"; }
# pynvml loads libnvidia-ml.so.1 by name: the link in $work/lib makes it the agent's.
nvml_read() { LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" py nvml "$R/nvml-$1.json"; }
agent_request() { py request "$work/run/observe.sock" "$1"; }
field() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"d": d}))' "$@"; }

# --- before anything starts: every GPU's limit ------------------------------------------
say "NVML library: $nvml"
nvml_read pre || refuse "NVML (pynvml through $nvml) cannot be read; see the error above"
count=$(field "$R/nvml-pre.json" 'len(d["gpus"])')
[ "$gpu" -lt "$count" ] || refuse "--gpu $gpu: NVML lists $count GPU(s)"
simulated=$(field "$R/nvml-pre.json" 'any(g["name"].endswith("(simulated)") for g in d["gpus"])')
gpu_uuid=$(field "$R/nvml-pre.json" "d['gpus'][$gpu]['uuid']")
say "$count GPU(s); GPU $gpu is $(field "$R/nvml-pre.json" "d['gpus'][$gpu]['name']") ($gpu_uuid), limit $(field "$R/nvml-pre.json" "d['gpus'][$gpu]['limit_w']") W"
if [ "$simulated" = True ]; then
    say "SIMULATED GPUs: every figure below is simulated"
    [ -n "${POWERFLEX_SIM_DIR:-}" ] || refuse "the simulated library needs POWERFLEX_SIM_DIR (the node directory powerflex-sim init made)"
    [ -x "$bin_dir/powerflex-simjob" ] || refuse "no powerflex-simjob in $bin_dir for the simulated GPU work"
fi

# --- the agent's config: written here, read back, refused unless observe mode ----------
config=$work/powerflex.toml
gen=(config --nvml "$R/nvml-pre.json" --out "$config" --work "$work" --library "$nvml")
[ "${GPU_OBSERVE_TEST_WRITE_ENFORCE:-}" = 1 ] && gen+=(--enforce-for-test)
py "${gen[@]}"
py check-config "$config" --work "$work" # exits 2 with the reason unless enforce = false
say "observe mode: $config says agent.enforce = false"

# --- the agent ---------------------------------------------------------------------------
"$agent_bin" --config "$config" --node observe --sample-interval-ms "$interval_ms" \
    </dev/null >"$work/agent.log" 2>&1 &
agent_pid=$!
for _ in $(seq 300); do
    [ -S "$work/run/observe.sock" ] && break
    kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log" >&2; refuse "powerflexd exited at start (its log is above)"; }
    sleep 0.1
done
[ -S "$work/run/observe.sock" ] || refuse "powerflexd did not open its socket in 30 s"
agent_request '{"v":1,"op":"status"}' >"$R/agent-boot.json"
enforce=$(field "$R/agent-boot.json" 'd["status"].get("enforce", True)')
if [ "$enforce" != False ]; then
    refuse "refusing: powerflexd (pid $agent_pid) reports enforce = $enforce: observe mode is off; stopping it"
fi
say "powerflexd pid $agent_pid in observe mode (status: enforce = false), sampling every $interval_ms ms"

# --- the job, registered as the SPANK plugin registers it --------------------------------
job=$((4000000 + $$ % 1000000))
nvml_read register-before
agent_request "{\"v\":1,\"op\":\"register\",\"job_id\":\"$job\",\"step_id\":\"0\",\"uid\":$train_uid,\"node\":\"observe\",\"gpus\":[\"$gpu\"],\"flex\":\"$flex\"}" >"$R/register.json"
nvml_read register-after
[ "$(field "$R/register.json" 'd["ok"]')" = True ] || refuse "the agent refused the job: $(field "$R/register.json" 'd.get("error")')"
progress=$(field "$R/register.json" 'd.get("progress") or ""')
[ -n "$progress" ] || refuse "the agent gave no progress address for --power-flex=$flex (an unmanaged tier?)"
say "job $job registered on GPU $gpu ($flex, uid $train_uid); progress to $progress"

# The job's step: the training loop, and on simulated GPUs the simulated GPU work. The
# job's environment is what a Slurm job would have of ours: the invoker's PATH and
# Python/library paths (a venv's torch), the job id, the progress address, its GPU.
job_env=(env -i "PATH=$PATH" HOME=/tmp "SLURM_JOB_ID=$job")
for var in PYTHONPATH LD_LIBRARY_PATH VIRTUAL_ENV CONDA_PREFIX; do
    [ -n "${!var:-}" ] && job_env+=("$var=${!var}")
done
stop_file=$work/job/stop
train=("$job_python" "$work/job/gpu_observe_train.py" --helper-dir "$work/job"
    --stop-file "$stop_file" --max-seconds $((seconds + 240)))
q() { printf '%q ' "$@"; }
{
    echo "cd /"
    if [ "$simulated" = True ]; then
        train+=(--cpu-only)
        echo "$(q "${as_user[@]}" "${job_env[@]}" "POWERFLEX_SIM_DIR=$POWERFLEX_SIM_DIR" "SLURM_JOB_GPUS=$gpu" \
            "$bin_dir/powerflex-simjob" --profile synthetic-compute-bound --duration 86400) \
            </dev/null >$(q "$work/job/simjob.out") 2>$(q "$work/job/simjob.err") &"
        echo 'sim=$!'
    fi
    echo "$(q "${as_user[@]}" "${job_env[@]}" "POWERFLEX_PROGRESS=$progress" "CUDA_VISIBLE_DEVICES=$gpu_uuid" \
        "${train[@]}") </dev/null >$(q "$work/job/train.out") 2>$(q "$work/job/train.err")"
    echo 'rc=$?'
    [ "$simulated" = True ] && echo 'kill -TERM "$sim" 2>/dev/null; wait "$sim"'
    echo 'exit "$rc"'
} >"$work/job/step.sh"
cp /bin/sh "$work/bin/slurmstepd"
(exec -a "slurmstepd: [$job.0]" "$work/bin/slurmstepd" <"$work/job/step.sh") &
stepd_pid=$!

# CUDA start-up (the import, the context) can take a while; the first step says "started".
for _ in $(seq 1800); do
    grep -q '"event": "started"' "$work/job/train.out" 2>/dev/null && break
    kill -0 "$stepd_pid" 2>/dev/null || break
    sleep 0.1
done
grep -q '"event": "started"' "$work/job/train.out" 2>/dev/null || {
    cat "$work/job/train.err" >&2 2>/dev/null || true
    refuse "the training loop did not start in 180 s (its errors are above)"
}
say "training: $(field <(head -1 "$work/job/train.out") 'd["label"]')"
# One sample and one scan of the host's processes (every 2 s) before the first reading.
sleep 2.5

sample() { # start | end
    nvml_read "$1"
    agent_request '{"v":1,"op":"status"}' >"$R/agent-$1.json"
    py smi "$R/smi-$1.json"
}
sample start
say "start readings taken; training for $seconds s"
sleep "$seconds"
sample end
job_pids | python3 -c 'import json,sys; print(json.dumps([int(x) for x in sys.stdin.read().split()]))' >"$R/job-pids.json"
touch "$stop_file"
wait "$stepd_pid" || say "the job's step exited with status $?"
stepd_pid=""
cp "$work/job/train.out" "$R/train.out"

# --- the job's end, as the epilog reports it, and its record -----------------------------
nvml_read end-before
agent_request "{\"v\":1,\"op\":\"end-job\",\"job_id\":\"$job\"}" >"$R/end.json"
nvml_read end-after
usage=$work/state/observe/usage.jsonl
for _ in $(seq 100); do
    py record "$usage" "$job" "$R/record.json" 2>/dev/null && break
    sleep 0.1
done
[ -e "$R/record.json" ] || say "no record of job $job in $usage after 10 s"

# --- the agent stops; every GPU's limit once more -----------------------------------------
kill -TERM "$agent_pid"
for _ in $(seq 150); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.1; done
wait "$agent_pid" 2>/dev/null || say "powerflexd exited with status $?"
agent_pid=""
nvml_read post

sim_flag=()
[ "$simulated" = True ] && sim_flag=(--simulated-gpu-work)
set +e
py report --dir "$R" --job "$job" --gpu "$gpu" --library "$nvml" \
    --sample-interval-s "$(awk -v ms="$interval_ms" 'BEGIN {print ms / 1000}')" "${sim_flag[@]}" |
    tee "$R/report.txt"
verdict=${PIPESTATUS[0]}
set -e
exit "$verdict"
