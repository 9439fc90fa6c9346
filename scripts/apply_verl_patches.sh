#!/usr/bin/env bash
# Applies patches/*.patch to the verl installed in the project venv (or $PYTHON's). Idempotent.
#
#   scripts/apply_verl_patches.sh            # apply what is missing (a second run is a no-op)
#   scripts/apply_verl_patches.sh --check    # exit 0 only if every patch is applied
#   scripts/apply_verl_patches.sh --revert   # take every applied patch back out
#
# Each patch file opens with its symptom, cause, upstream link and test. Only verl 0.9.1 is accepted: the patches
# are exact diffs against its files.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
want_version="0.9.1"
mode="${1:-apply}"
case "$mode" in apply | --apply) mode=apply ;; --check) mode=check ;; --revert) mode=revert ;;
*) echo "usage: $0 [--check|--revert]" >&2; exit 2 ;; esac

command -v patch >/dev/null || { echo "apply_verl_patches: the 'patch' program is required" >&2; exit 1; }
read -r version site < <("$python" -c 'import os, verl; print(verl.__version__, os.path.dirname(os.path.dirname(verl.__file__)))') || {
    echo "apply_verl_patches: cannot import verl with $python" >&2; exit 1; }
if [ "$version" != "$want_version" ]; then
    echo "apply_verl_patches: verl $version is installed at $site; these patches are for verl $want_version only" >&2
    exit 1
fi

status=0
for p in "$root"/patches/*.patch; do
    name="$(basename "$p")"
    if patch -p1 -d "$site" --dry-run --silent --force -R <"$p" >/dev/null 2>&1; then
        state=applied
    elif patch -p1 -d "$site" --dry-run --silent --forward <"$p" >/dev/null 2>&1; then
        state=missing
    else
        echo "apply_verl_patches: $name neither applies nor reverts cleanly on $site/verl (edited by hand?)" >&2
        status=1
        continue
    fi
    case "$mode:$state" in
    check:applied) echo "ok       $name" ;;
    check:missing) echo "MISSING  $name"; status=1 ;;
    apply:applied) echo "present  $name" ;;
    apply:missing) patch -p1 -d "$site" --forward --silent --no-backup-if-mismatch <"$p" && echo "applied  $name" ;;
    revert:applied) patch -p1 -d "$site" -R --silent --no-backup-if-mismatch <"$p" && echo "reverted $name" ;;
    revert:missing) echo "absent   $name" ;;
    esac
done
exit $status
