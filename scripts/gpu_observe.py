"""The reading, writing-of-its-own-config and comparing half of scripts/gpu-observe.sh.

Every NVML call here is a getter: this file never sets a limit, a clock, a mode or
anything else on a GPU (it calls no NVML setter at all; tests/gpu_observe.rs checks the
script's files for one). pynvml (nvidia-ml-py) dlopens libnvidia-ml.so.1, so the library it reads is
chosen by LD_LIBRARY_PATH, which gpu-observe.sh points at a directory holding a link to
the same library the agent loads.

    gpu_observe.py nvml OUT.json                 # every GPU as NVML reports it now
    gpu_observe.py smi OUT.json                  # the same from nvidia-smi, if present
    gpu_observe.py config --nvml N.json --out F --work DIR --library LIB
    gpu_observe.py check-config F --work DIR     # refuses unless agent.enforce = false
    gpu_observe.py request SOCKET JSON-LINE      # one control request; prints the reply
    gpu_observe.py tree PID                      # the PIDs under PID (the job's)
    gpu_observe.py record USAGE.jsonl JOB OUT    # the job's final share, once written
    gpu_observe.py report --dir DIR ...          # side by side, verdict; exit 0/1

Standard library and pynvml only (Python 3.11: tomllib).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib

SIMULATED_SUFFIX = "(simulated)"
# NVML clock-event (throttle) reason bits, from nvml.h.
REASON_BITS = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
]
# What the agent counts as "power-throttled" (agent/src/backend.rs): a power cap or a
# power brake holding the clocks back.
POWER_REASONS = 0x4 | 0x80
# Limits compare within half a watt: NVML gives milliwatts, the agent rounds nothing,
# nvidia-smi prints two decimals.
LIMIT_TOLERANCE_W = 0.5


def fail(message, code=2):
    print(f"gpu-observe: {message}", file=sys.stderr)
    sys.exit(code)


def reasons_text(mask):
    if mask is None:
        return "unknown"
    names = [name for bit, name in REASON_BITS if mask & bit]
    return ",".join(names) if names else "none"


# ---------------------------------------------------------------- NVML (pynvml) ----


def read_nvml():
    """Every GPU as NVML reports it now, through getters only."""
    import pynvml

    def attempt(call, *args):
        try:
            return call(*args)
        except pynvml.NVMLError as e:
            return {"error": str(e)}

    def value(x):
        return None if isinstance(x, dict) else x

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            uuid = pynvml.nvmlDeviceGetUUID(h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            constraints = attempt(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, h)
            # Newer drivers name them clock-event reasons; older ones throttle reasons.
            reasons = None
            for getter in ("nvmlDeviceGetCurrentClocksEventReasons",
                           "nvmlDeviceGetCurrentClocksThrottleReasons"):
                if hasattr(pynvml, getter):
                    reasons = value(attempt(getattr(pynvml, getter), h))
                    if reasons is not None:
                        break
            procs = attempt(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
            energy = attempt(pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
            gpus.append({
                "index": i,
                "name": name,
                "uuid": uuid,
                "limit_w": mw(value(attempt(pynvml.nvmlDeviceGetPowerManagementLimit, h))),
                "enforced_w": mw(value(attempt(pynvml.nvmlDeviceGetEnforcedPowerLimit, h))),
                "default_w": mw(value(attempt(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h))),
                "min_w": mw(constraints[0]) if isinstance(constraints, (list, tuple)) else None,
                "max_w": mw(constraints[1]) if isinstance(constraints, (list, tuple)) else None,
                "power_w": mw(value(attempt(pynvml.nvmlDeviceGetPowerUsage, h))),
                "energy_mj": value(energy),
                "energy_error": energy.get("error") if isinstance(energy, dict) else None,
                "reasons": reasons,
                "pids": sorted(p.pid for p in procs) if isinstance(procs, list) else None,
                "pids_error": procs.get("error") if isinstance(procs, dict) else None,
            })
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        return {"at_unix_s": time.time(), "driver": driver, "gpus": gpus}
    finally:
        pynvml.nvmlShutdown()


def mw(x):
    return None if x is None else x / 1000.0


# ---------------------------------------------- nvidia-smi's read-only queries ----

SMI_FIELDS = [
    "index", "name", "uuid", "power.draw", "power.limit", "enforced.power.limit",
    "power.default_limit", "power.min_limit", "power.max_limit",
]
SMI_REASON_FIELDS = ["clocks_event_reasons.active", "clocks_throttle_reasons.active"]


def read_smi():
    """What nvidia-smi reports (read-only --query-* calls), or that it is absent."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"found": False}
    out = None
    for reason_field in SMI_REASON_FIELDS + [None]:
        fields = SMI_FIELDS + ([reason_field] if reason_field else [])
        r = subprocess.run(
            [smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            out = (fields, r.stdout)
            break
    if out is None:
        return {"found": True, "error": (r.stderr or r.stdout).strip()}
    fields, text = out
    gpus = []
    for line in text.strip().splitlines():
        cols = [c.strip() for c in line.split(",")]
        row = dict(zip(fields, cols))

        def num(key):
            try:
                return float(row.get(key, ""))
            except ValueError:
                return None

        reasons = None
        for f in SMI_REASON_FIELDS:
            if f in row:
                try:
                    reasons = int(row[f], 16)
                except ValueError:
                    reasons = None
        gpus.append({
            "index": int(row["index"]), "name": row["name"], "uuid": row["uuid"],
            "power_w": num("power.draw"), "limit_w": num("power.limit"),
            "enforced_w": num("enforced.power.limit"), "default_w": num("power.default_limit"),
            "min_w": num("power.min_limit"), "max_w": num("power.max_limit"),
            "reasons": reasons,
        })
    apps = subprocess.run(
        [smi, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=30)
    pids = {}
    if apps.returncode == 0:
        for line in apps.stdout.strip().splitlines():
            cols = [c.strip() for c in line.split(",")]
            if len(cols) == 2 and cols[0].isdigit():
                pids.setdefault(cols[1], []).append(int(cols[0]))
    for g in gpus:
        g["pids"] = sorted(pids.get(g["uuid"], [])) if apps.returncode == 0 else None
    return {"found": True, "path": smi, "at_unix_s": time.time(), "gpus": gpus}


# ------------------------------------------------------------ the site config ----


def toml_string(s):
    return json.dumps(s)  # a JSON string is a valid TOML basic string for these inputs


def write_config(nvml, out, work, library, enforce_for_test):
    """The agent's site config, in the private work directory: observe mode, standalone
    (no controller, no link key), its own sockets and state, the GPU model as NVML names
    it with NVML's own constraints."""
    first = nvml["gpus"][0]
    name = "".join(c for c in first["name"] if 0x20 <= ord(c) <= 0x7E).strip()[:64]
    if not name:
        fail(f"NVML names GPU 0 {first['name']!r}: no printable model name to configure")
    lo, hi = first["min_w"], first["max_w"]
    if lo is None or hi is None:
        fail("NVML gives no power-limit constraints for GPU 0; the agent needs them")
    if hi - lo < 1.0:
        # A board whose limit cannot move: the agent only clamps to it.
        lo = hi - 1.0
    step = min(10.0, hi - lo)
    budget = sum(g["max_w"] or 0.0 for g in nvml["gpus"]) * 2
    text = f"""# Written by scripts/gpu-observe.sh for one read-only run; never a site's config.
[facility]
gpu_budget_w = {budget:.1f}

[tiers]
default = "none"

[[tiers.tier]]
name = "flex0"
max_slowdown_pct = 0.0

[[tiers.tier]]
name = "flex1"
max_slowdown_pct = 10.0

[[tiers.tier]]
name = "flex2"
max_slowdown_pct = 25.0

[[tiers.tier]]
name = "flex3"
max_slowdown_pct = 50.0

[gpu_models.{toml_string(name)}]
min_cap_w = {lo:.3f}
max_cap_w = {hi:.3f}
cap_step_w = {step:.3f}
failsafe_cap_w = {hi:.3f}

[controller]
# Standalone agent (agent.node_budget_w): no controller is contacted.
listen = "127.0.0.1:9"

[agent]
# Observe mode: the agent measures, accounts and reports, and never writes a limit.
enforce = {"true" if enforce_for_test else "false"}
node_budget_w = {budget:.1f}
nvml_library = {toml_string(library)}
socket = {toml_string(os.path.join(work, "run", "%n.sock"))}
state_dir = {toml_string(os.path.join(work, "state", "%n"))}
key_file = {toml_string(os.path.join(work, "no-link.key"))}
usage_log = true
"""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def check_config(path, work):
    """Refuses (exit 2) unless the config says observe mode, plainly, and keeps every
    path of the agent inside the private work directory."""
    real_work = os.path.realpath(work)
    if not os.path.realpath(path).startswith(real_work + os.sep):
        fail(f"refusing: {path} is not inside the private work directory {work}")
    st = os.stat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        fail(f"refusing: {path} must be ours and mode 0600 (found uid {st.st_uid}, "
             f"mode {st.st_mode & 0o777:o})")
    with open(path, "rb") as f:
        config = tomllib.load(f)
    agent = config.get("agent", {})
    enforce = agent.get("enforce")
    if enforce is not False:
        said = {True: "true", None: "absent, so true"}.get(enforce, repr(enforce))
        fail(f"refusing: observe mode is off in {path} (agent.enforce = {said}); "
             "this script runs powerflexd only with agent.enforce = false, so that no "
             "limit is ever written")
    for key in ("socket", "state_dir", "key_file"):
        p = agent.get(key, "")
        if not os.path.realpath(p.replace("%n", "n")).startswith(real_work + os.sep):
            fail(f"refusing: agent.{key} = {p!r} is outside the work directory {work}")


# ------------------------------------------------------------------ the socket ----


def request(path, line, timeout_s=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    s.connect(path)
    s.sendall(line.encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    return json.loads(data)


# ------------------------------------------------------------- processes, record ----


def tree(root):
    """The PIDs descending from `root` (not `root` itself), from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # `pid (comm) state ppid ...`: comm may hold spaces; count from the last ')'.
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return sorted(found)


def find_record(usage_log, job, out):
    """The job's final share from the agent's usage.jsonl; exit 1 while it is not there."""
    try:
        with open(usage_log) as f:
            lines = f.readlines()
    except OSError:
        sys.exit(1)
    for text in reversed(lines):
        try:
            rec = json.loads(text)
        except ValueError:
            continue
        if rec.get("job_id") == job:
            with open(out, "w") as f:
                json.dump(rec, f)
            return
    sys.exit(1)


# ---------------------------------------------------------------------- report ----


def load(dir_, name):
    path = os.path.join(dir_, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(x, unit="", digits=1):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


class Verdict:
    def __init__(self):
        self.rows = []

    def check(self, what, ok, detail):
        self.rows.append((what, ok, detail))
        return ok

    def failed(self):
        return [r for r in self.rows if not r[1]]


def report(args):
    d = args.dir
    pre, post = load(d, "nvml-pre.json"), load(d, "nvml-post.json")
    reg_a, reg_b = load(d, "nvml-register-before.json"), load(d, "nvml-register-after.json")
    end_a, end_b = load(d, "nvml-end-before.json"), load(d, "nvml-end-after.json")
    n_start, n_end = load(d, "nvml-start.json"), load(d, "nvml-end.json")
    # The agent's status replies: {"v":1,"ok":true,"status":{...}}.
    a_start, a_end = load(d, "agent-start.json")["status"], load(d, "agent-end.json")["status"]
    s_start, s_end = load(d, "smi-start.json"), load(d, "smi-end.json")
    record = load(d, "record.json")
    train = {}
    if os.path.exists(os.path.join(d, "train.out")):
        with open(os.path.join(d, "train.out")) as f:
            for text in f:
                try:
                    train.update(json.loads(text))
                except ValueError:
                    pass
    # The GPU has work on it: PyTorch on CUDA, or the simulated job on a simulated GPU.
    train["uses_gpu"] = train.get("mode") == "cuda" or args.simulated_gpu_work
    if args.simulated_gpu_work:
        train["label"] = (train.get("label", "?") + "; the GPU work is powerflex-simjob "
                          "(SIMULATED)")
    train["job_pids"] = load(d, "job-pids.json") or []
    job, gpu = args.job, args.gpu
    v = Verdict()
    simulated = any(g["name"].endswith(SIMULATED_SUFFIX) for g in pre["gpus"])
    label = " (SIMULATED)" if simulated else ""

    print()
    print(f"== gpu-observe: powerflexd in observe mode against {args.library}{label}")
    print(f"   driver {pre['driver']}; job {job} on GPU {gpu}; training: {train.get('mode', '?')}"
          f" — {train.get('label', 'no training report')}")
    if s_start is None or not s_start.get("found"):
        print("   nvidia-smi: not found — comparing with nvidia-ml-py (pynvml) alone")
    elif s_start.get("error"):
        print(f"   nvidia-smi: failed ({s_start['error']}) — comparing with pynvml alone")
    smi_ok = bool(s_start and s_start.get("found") and not s_start.get("error"))

    def smi_gpu(snap, i):
        if not smi_ok or not snap or not snap.get("gpus"):
            return None
        return next((g for g in snap["gpus"] if g["index"] == i), None)

    def agent_gpu(snap, i):
        return next((g for g in snap["gpus"] if g["index"] == i), None)

    # --- observe mode
    v.check("observe mode", a_start["enforce"] is False and a_end["enforce"] is False,
            f"agent status enforce = {json.dumps(a_start['enforce'])} at start, "
            f"{json.dumps(a_end['enforce'])} at end")

    # --- per GPU: name, limits, constraints (every GPU the agent sees)
    print()
    print(f"{'GPU':>3}  {'quantity':<22} {'agent':>24} {'pynvml':>24} {'nvidia-smi':>24}")
    for ng in n_end["gpus"]:
        i = ng["index"]
        ag = agent_gpu(a_end, i)
        sg = smi_gpu(s_end, i)
        if ag is None:
            v.check(f"GPU {i} seen", False, "NVML lists it, the agent's status does not")
            continue
        rows = [
            ("name", ag["name"], ng["name"], sg and sg["name"]),
            ("limit (set) W", ag.get("cap_w"), ng["limit_w"], sg and sg["limit_w"]),
            ("enforced limit W", None, ng["enforced_w"], sg and sg["enforced_w"]),
            ("default limit W", ag["default_w"], ng["default_w"], sg and sg["default_w"]),
            ("min limit W", ag.get("min_w"), ng["min_w"], sg and sg["min_w"]),
            ("max limit W", ag.get("max_w"), ng["max_w"], sg and sg["max_w"]),
            ("would cap W", ag.get("would_cap_w"), None, None),
            ("power W (own instants)", ag.get("power_w"), ng["power_w"], sg and sg["power_w"]),
            ("power-throttled", ag.get("power_throttled"),
             None if ng["reasons"] is None else bool(ng["reasons"] & POWER_REASONS),
             None if not sg or sg["reasons"] is None else bool(sg["reasons"] & POWER_REASONS)),
            ("clock-event reasons", None, reasons_text(ng["reasons"]),
             sg and reasons_text(sg["reasons"])),
            ("processes (pids)", [p["pid"] for p in ag.get("processes", [])], ng["pids"],
             sg and sg["pids"]),
        ]
        for what, a, n, s in rows:
            print(f"{i:>3}  {what:<22} {fmt(a):>24} {fmt(n):>24} {fmt(s):>24}")
        names = {ag["name"], ng["name"]} | ({sg["name"]} if sg else set())
        v.check(f"GPU {i} name", len(names) == 1, " / ".join(sorted(names)))
        for key, what in (("default_w", "default limit"), ("min_w", "min limit"),
                          ("max_w", "max limit")):
            theirs = [ng[key]] + ([sg[key]] if sg else [])
            ok = ag.get(key) is not None and all(
                t is not None and abs(ag[key] - t) <= LIMIT_TOLERANCE_W for t in theirs)
            v.check(f"GPU {i} {what}", ok,
                    f"agent {fmt(ag.get(key))} W, NVML {' / '.join(fmt(t) for t in theirs)} W"
                    f" (within {LIMIT_TOLERANCE_W} W)")
        theirs = [ng["limit_w"]] + ([sg["limit_w"]] if sg else [])
        ok = ag.get("cap_w") is not None and all(
            t is not None and abs(ag["cap_w"] - t) <= LIMIT_TOLERANCE_W for t in theirs)
        v.check(f"GPU {i} limit", ok, f"agent read back {fmt(ag.get('cap_w'))} W, NVML "
                f"{' / '.join(fmt(t) for t in theirs)} W (within {LIMIT_TOLERANCE_W} W)")
        print()

    # --- no limit changed, on any GPU, at any of our reads
    snaps = [("before the agent", pre), ("job registered", reg_b), ("start", n_start),
             ("end", n_end), ("job ended", end_b), ("after the agent stopped", post)]
    for g0 in pre["gpus"]:
        i = g0["index"]
        seen = [(when, next((g["limit_w"] for g in s["gpus"] if g["index"] == i), None))
                for when, s in snaps if s]
        changed = [(when, w) for when, w in seen if w != g0["limit_w"]]
        v.check(f"GPU {i} limit unchanged", not changed,
                f"{fmt(g0['limit_w'])} W throughout" if not changed else
                "POWER LIMIT CHANGED: " + ", ".join(f"{fmt(w)} W at {when}" for when, w in
                                                    changed) +
                f" (was {fmt(g0['limit_w'])} W before the agent started; the agent counted "
                f"{a_end.get('cap_mismatches', '?')} limit(s) changed behind it)")

    # --- energy: the counter's advance, agent vs NVML
    ng_s = next(g for g in n_start["gpus"] if g["index"] == gpu)
    ng_e = next(g for g in n_end["gpus"] if g["index"] == gpu)
    ag_s, ag_e = agent_gpu(a_start, gpu), agent_gpu(a_end, gpu)
    print(f"-- energy counter of GPU {gpu}{label}")
    if ng_s["energy_mj"] is None:
        print(f"   NVML: no energy counter ({ng_s['energy_error']}); the agent charges power x time")
    else:
        n_adv = (ng_e["energy_mj"] - ng_s["energy_mj"]) / 1000.0
        a_adv = None
        if ag_s.get("energy_j") is not None and ag_e.get("energy_j") is not None:
            a_adv = ag_e["energy_j"] - ag_s["energy_j"]
        span = n_end["at_unix_s"] - n_start["at_unix_s"]
        # The agent's status carries its last sample, up to one sample interval old (more
        # on a busy machine), at each end: allow that much at the GPU's highest limit.
        tol = 2.0 * (args.sample_interval_s + 1.0) * (ng_s["max_w"] or 0.0)
        print(f"   status, start to end ({span:.1f} s): agent {fmt(a_adv, ' J')}, "
              f"pynvml {fmt(n_adv, ' J')}")
        v.check("energy advance (status)", a_adv is not None and abs(a_adv - n_adv) <= tol,
                f"agent {fmt(a_adv, ' J')} vs pynvml {fmt(n_adv, ' J')}, within "
                f"{tol:.0f} J = 2 x (sample interval + 1 s) x max limit")

    # --- the training process in NVML's process list
    pids_n = ng_e["pids"]
    procs_a = ag_e.get("processes", [])
    pids_a = sorted(p["pid"] for p in procs_a)
    mine = [p["pid"] for p in procs_a if p.get("job") == job]
    job_pids = set(train.get("job_pids", []))
    print(f"-- processes on GPU {gpu}: NVML (pynvml) {pids_n}, agent {pids_a}; "
          f"the job's processes {sorted(job_pids)}; the agent attributes {mine} to job {job}")
    if pids_n is not None:
        v.check("process list", set(pids_a) == set(pids_n),
                f"agent {pids_a} vs pynvml {pids_n} (the agent scans every 2 s)")
    if train.get("uses_gpu"):
        v.check("training process found", bool(mine) and set(mine) <= job_pids,
                f"NVML lists {pids_n}; the agent puts {mine} in job {job}" +
                ("" if mine else " — none: NVML lists no process of the job's tree (a "
                 "container without the host's PID namespace shows host pids)"))
    else:
        print("   the CPU-only stand-in runs nothing on the GPU: no process to find")

    # --- the job's energy record
    print(f"-- the job's energy record (usage.jsonl, node {record and record.get('node')}){label}")
    if record is None:
        v.check("energy record", False, "the agent wrote no record for the job")
    else:
        g = next((x for x in record["gpus"] if x["index"] == gpu), None)
        dur = (record["to_unix_ms"] - record["from_unix_ms"]) / 1000.0
        print(f"   job {record['job_id']} tier {record['tier']} uid {record['uid']}: "
              f"{record['energy_mj'] / 1000.0:.1f} J ({record['energy_source']}) over {dur:.1f} s, "
              f"peak {record['peak_power_w']:.1f} W, capped {record['capped_s']:.1f} s, "
              f"power-throttled {record['power_throttled_s']:.1f} of "
              f"{record['throttle_known_s']:.1f} s, work {record.get('work')} "
              f"{record.get('work_unit') or ''}, simulated {json.dumps(record['simulated'])}")
        v.check("record: simulated label", record["simulated"] == simulated,
                f"record says simulated = {json.dumps(record['simulated'])}, the GPU names "
                f"say {json.dumps(simulated)}")
        # The agent wrote nothing, so the only limit the job can have run at is the one
        # found before the agent started (below the default it counts as "capped").
        found = next(x["limit_w"] for x in pre["gpus"] if x["index"] == gpu)
        caps = [c["cap_w"] for c in record.get("caps", [])]
        v.check("record: only the limit found", bool(caps) and all(
            abs(c - found) <= LIMIT_TOLERANCE_W for c in caps),
            f"the record's caps {caps} W, the limit before the agent started {fmt(found)} W")
        if g is None:
            v.check("energy record", False, f"the record has no GPU {gpu}")
        elif g["counter_from_mj"] is None:
            v.check("record: source", record["energy_source"] == "integrated"
                    and ng_s["energy_mj"] is None,
                    f"record {record['energy_source']}, NVML counter "
                    f"{'absent' if ng_s['energy_mj'] is None else 'present'}")
        else:
            e = lambda snap: next(x["energy_mj"] for x in snap["gpus"] if x["index"] == gpu)
            lo_from, hi_from = e(reg_a), e(reg_b)
            lo_to, hi_to = e(end_a), e(end_b)
            print(f"   counter at registration {g['counter_from_mj']} mJ (pynvml read "
                  f"{lo_from}..{hi_from} around it), at the end {g['counter_to_mj']} mJ "
                  f"(pynvml {lo_to}..{hi_to})")
            v.check("record: counter at registration",
                    lo_from <= g["counter_from_mj"] <= hi_from,
                    f"{g['counter_from_mj']} mJ within pynvml's {lo_from}..{hi_from} mJ read "
                    "just before and after the registration (a monotonic counter: no tolerance)")
            v.check("record: counter at the end", lo_to <= g["counter_to_mj"] <= hi_to,
                    f"{g['counter_to_mj']} mJ within pynvml's {lo_to}..{hi_to} mJ read just "
                    "before and after end-job")
            v.check("record: energy = counter advance",
                    g["energy_mj"] == g["counter_to_mj"] - g["counter_from_mj"],
                    f"{g['energy_mj']} mJ charged, counter advanced "
                    f"{g['counter_to_mj'] - g['counter_from_mj']} mJ")

    print()
    print("-- verdict")
    for what, ok, detail in v.rows:
        print(f"   {'ok  ' if ok else 'FAIL'} {what}: {detail}")
    bad = v.failed()
    if bad:
        print(f"gpu-observe: FAIL — {len(bad)} of {len(v.rows)} checks: "
              + "; ".join(w for w, _, _ in bad))
        return 1
    print(f"gpu-observe: PASS — {len(v.rows)} checks; the agent and NVML agree and no limit "
          f"changed{label}")
    return 0


# ------------------------------------------------------------------------ main ----


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("nvml")
    s.add_argument("out")
    s = sub.add_parser("smi")
    s.add_argument("out")
    s = sub.add_parser("config")
    for a in ("--nvml", "--out", "--work", "--library"):
        s.add_argument(a, required=True)
    s.add_argument("--enforce-for-test", action="store_true")
    s = sub.add_parser("check-config")
    s.add_argument("path")
    s.add_argument("--work", required=True)
    s = sub.add_parser("request")
    s.add_argument("socket")
    s.add_argument("line")
    s = sub.add_parser("report")
    s.add_argument("--dir", required=True)
    s.add_argument("--job", required=True)
    s.add_argument("--gpu", type=int, required=True)
    s.add_argument("--library", required=True)
    s.add_argument("--sample-interval-s", type=float, required=True)
    s.add_argument("--simulated-gpu-work", action="store_true")
    s = sub.add_parser("tree")
    s.add_argument("pid", type=int)
    s = sub.add_parser("record")
    s.add_argument("usage_log")
    s.add_argument("job")
    s.add_argument("out")
    args = p.parse_args()

    if args.cmd in ("nvml", "smi"):
        data = read_nvml() if args.cmd == "nvml" else read_smi()
        with open(args.out, "w") as f:
            json.dump(data, f)
    elif args.cmd == "config":
        with open(args.nvml) as f:
            nvml = json.load(f)
        write_config(nvml, args.out, args.work, args.library, args.enforce_for_test)
    elif args.cmd == "check-config":
        check_config(args.path, args.work)
    elif args.cmd == "request":
        try:
            print(json.dumps(request(args.socket, args.line)))
        except (OSError, ValueError) as e:
            fail(f"no answer from the agent at {args.socket}: {e}", 1)
    elif args.cmd == "report":
        try:
            code = report(args)
        except Exception:  # a reading missing or malformed: no verdict, so no pass
            import traceback
            traceback.print_exc()
            print("gpu-observe: FAIL — the readings could not be compared (above)")
            code = 1
        sys.exit(code)
    elif args.cmd == "tree":
        print(" ".join(str(pid) for pid in tree(args.pid)))
    elif args.cmd == "record":
        find_record(args.usage_log, args.job, args.out)


if __name__ == "__main__":
    main()
