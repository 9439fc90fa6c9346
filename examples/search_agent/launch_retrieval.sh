#!/usr/bin/env bash
# Start the search agent's retrieval server in the background and wait until it answers /health.
#   bash examples/search_agent/launch_retrieval.sh [--corpus PATH] [--port 8000] [--host 127.0.0.1]
# Generates the corpus first when PATH does not exist (examples/search_agent/corpus.py). Prints the server's pid;
# its log is RETRIEVAL_LOG (default /tmp/fa_retrieval_<port>.log). Stop it with: kill <pid>.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
corpus="$HOME/data/search_agent/corpus.jsonl"
host=127.0.0.1
port=8000
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --corpus) corpus="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
    esac
done
py="$root/.venv/bin/python"
if [[ ! -f "$corpus" ]]; then
    (cd "$root" && "$py" -m examples.search_agent.corpus --out "$(dirname "$corpus")" >&2)
fi
log="${RETRIEVAL_LOG:-/tmp/fa_retrieval_${port}.log}"
cd "$root"
nohup "$py" -m examples.search_agent.retrieval_server --corpus "$corpus" --host "$host" --port "$port" \
    ${extra[@]+"${extra[@]}"} >"$log" 2>&1 &
pid=$!
for _ in $(seq 1 120); do
    if "$py" -c "import urllib.request, sys; urllib.request.urlopen('http://$host:$port/health', timeout=1)" 2>/dev/null; then
        echo "$pid"
        exit 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "retrieval server exited; log $log:" >&2 && tail -20 "$log" >&2 && exit 1; }
    sleep 0.5
done
echo "retrieval server did not answer /health in 60 s; log $log" >&2
kill "$pid"
exit 1
