#!/usr/bin/env bash
# The daemon's own CPU per sandbox run through the HTTP API: starts
# `runcell serve` (standby pool of 2), runs N sequential create + exec
# `/usr/bin/python3 -c pass` + delete over one kept-alive connection (150 ms
# apart, as the API benchmark does, so the pool refills between runs), and
# reads the daemon's utime+stime from /proc/PID/stat before and after (its
# threads only; the sandboxes it reaped are shown apart). R rounds.
# Usage (root, release build): scripts/bench-daemon-cpu.sh [N] [R] [RUNCELL]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/bench-daemon.sh
n=${1:-60}
rounds=${2:-3}
runcell=${3:-target/release/runcell}
for round in $(seq "$rounds"); do
  trap bench_daemon_stop EXIT
  bench_daemon_start "$runcell" daemon-cpu "$round"
  printf 'round %d: ' "$round"
  python3 - "$BENCH_PORT" "$BENCH_DIR/api-key" "$BENCH_PID" "$n" <<'PY'
import http.client, json, subprocess, sys, time
port, keyfile, pid, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
h = {"Authorization": "Bearer " + open(keyfile).read().strip(), "Content-Type": "application/json"}
c = http.client.HTTPConnection("127.0.0.1", port)
tck = int(subprocess.check_output(["getconf", "CLK_TCK"]))
def ticks():
    # (own, reaped) clock ticks: scripts/lib/bench-daemon.sh's proc_cpu_ticks.
    out = subprocess.check_output(
        ["bash", "-c", '. scripts/lib/bench-daemon.sh && proc_cpu_ticks "$0"', str(pid)])
    own, reaped = out.split()
    return int(own), int(reaped)
def call(m, p, body=None):
    c.request(m, p, body=None if body is None else json.dumps(body), headers=h)
    r = c.getresponse()
    return r.status, r.read()
def cycle():
    s, d = call("POST", "/v1/sandboxes", {"template": "host"})
    assert s == 201, (s, d)
    i = json.loads(d)["id"]
    s, d = call("POST", f"/v1/sandboxes/{i}/exec", {"cmd": "/usr/bin/python3 -c pass"})
    assert s == 200 and json.loads(d)["exit_code"] == 0, (s, d)
    s, d = call("DELETE", f"/v1/sandboxes/{i}")
    assert s == 204, (s, d)
for _ in range(3):
    cycle()
    time.sleep(0.15)
time.sleep(1)
own0, ch0 = ticks()
lat = []
for _ in range(n):
    t = time.perf_counter()
    cycle()
    lat.append((time.perf_counter() - t) * 1000)
    time.sleep(0.15)
time.sleep(1)  # the last run's teardown and pool refill
own1, ch1 = ticks()
lat.sort()
print(f"{n} runs: daemon CPU {(own1 - own0) * 1000 / tck / n:.2f} ms/run "
      f"(sandboxes it reaped {(ch1 - ch0) * 1000 / tck / n:.2f}), "
      f"latency p50 {lat[n // 2]:.1f} ms p95 {lat[int(n * 0.95)]:.1f} ms")
PY
  bench_daemon_stop
  trap - EXIT
done
