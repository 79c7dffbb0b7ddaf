#!/usr/bin/env bash
# One window of a lent GPU: the backlog's steps (tools/gpu-backlog.steps) in order, each resuming where
# the last window stopped, until BUDGET_S seconds have passed (0: no limit); then results/raw/ (the raw
# rows, and each step's log and done-mark under results/raw/gpu-window/) tarred into $OUT.
#
#   tools/gpu-window.sh [BUDGET_S] [STEPS_FILE]
#
# Made for a device that allows a command 10 minutes and keeps nothing between starts: give a budget
# under that limit, carry results/raw (and .gpu, the offline wheels) to each call, and unpack the
# tarball here after each (tar xzf gpu-window.tgz). A step the budget cuts short loses at most its cell
# in flight and runs on in the next window; a step that ended, passed or failed, is not run again. A
# step cut twice after at least STALL_S seconds (default 120) without a new file under results/raw (a
# cell that outlasts a window, tests that need more than one) is given up: marked "stalled", so the
# steps after it get their turn.
set -u
budget_s=${1:-540}
steps_file=${2:-tools/gpu-backlog.steps}
out=${OUT:-results}
marks=results/raw/gpu-window
started=$(date +%s)
mkdir -p "$marks" "$out"
[ -f .gpu/setup.sh ] && source .gpu/setup.sh
export PY=${PY:-python3} LLAMA3B_RUN=${LLAMA3B_RUN:-llama3b-h100-20261122}
export BENCH_GIT_SHA=${BENCH_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# `bench run` starts no cell that its stack's earlier rows say would end after the window (15 s kept for its
# tables and the tarball): a cell the window's end cuts is lost whole. It exits 124 then, with time left: the
# steps after it use that time, and it resumes first in the next window (given up if it stops so twice without
# a new row: its next cell would outlast any window)
[ "$budget_s" -gt 0 ] && export BENCH_STOP_AT=$((started + budget_s - 15))

stall_s=${STALL_S:-120}

left_s() {  # seconds left in the window; a large number when there is no budget
  if [ "$budget_s" -eq 0 ]; then echo 999999; else echo $((started + budget_s - $(date +%s))); fi
}

rows_now() {  # files under results/raw, the window's own marks and logs left out: a step's progress
  find results/raw -type f -not -path "$marks/*" | wc -l
}

stall() {  # NAME: one more stall of the step; prints how many it has had
  local stalls=$(( $(cat "$marks/$1.stalls" 2>/dev/null || echo 0) + 1 ))
  echo "$stalls" > "$marks/$1.stalls"; echo "$stalls"
}

cut_short() {  # NAME RAN_S ROWS_BEFORE: a step the window's end stopped; given up on its second stall
  local stalls=0
  if [ "$(rows_now)" -ne "$3" ]; then
    rm -f "$marks/$1.stalls"  # progress: earlier stalls were windows ending at a bad moment
  elif [ "$2" -ge "$stall_s" ]; then
    stalls=$(stall "$1")
  fi
  if [ "$stalls" -ge 2 ]; then
    echo stalled > "$marks/$1.done"
    echo "$1: cut twice after $2 s or more without a new row: given up (its log: $marks/$1.log)"
  else
    echo "$1: cut by the window's end after $2 s; it resumes in the next"
  fi
}

stopped_itself() {  # NAME ROWS_BEFORE: `bench run` stopped before a cell that would outlast the window
  if [ "$(rows_now)" -ne "$2" ]; then
    rm -f "$marks/$1.stalls"
  elif [ "$(stall "$1")" -ge 2 ]; then  # twice without a row: its next cell outlasts even a whole window
    echo stalled > "$marks/$1.done"
    echo "$1: stopped twice before its next cell without a new row: given up (its log: $marks/$1.log)"; return
  fi
  echo "$1: stopped before a cell that would outlast the window; it resumes in the next, the steps after it go on"
}

while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  name=${line%%:*} command=${line#*: }
  if [ -f "$marks/$name.done" ]; then
    echo "$name: ended in an earlier window (exit $(cat "$marks/$name.done"))"; continue
  fi
  left=$(left_s)
  if [ "$left" -le 10 ]; then
    echo "window over: $name and the steps after it wait for the next"; break
  fi
  if [ "$budget_s" -eq 0 ]; then echo "$name: running: $command"; else echo "$name: running, at most ${left} s: $command"; fi
  rows=$(rows_now) step_started=$(date +%s)
  timeout --signal=TERM --kill-after=20 "$left" bash -c "$command" >> "$marks/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ] && [ "$(left_s)" -gt 30 ]; then  # not the timeout: the step's own --stop-at
    stopped_itself "$name" "$rows"; continue
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    cut_short "$name" $(( $(date +%s) - step_started )) "$rows"; break
  fi
  echo "$rc" > "$marks/$name.done"
  echo "$name: ended, exit $rc"
done < "$steps_file"

steps=$(grep -cvE '^(#|$)' "$steps_file"); ended=$(ls "$marks"/*.done 2>/dev/null | wc -l)
echo "steps ended: $ended of $steps; window used $(( $(date +%s) - started )) s"
tar czf "$out/gpu-window.tgz" results/raw && echo "raw rows and logs: $out/gpu-window.tgz ($(du -h "$out/gpu-window.tgz" | cut -f1))"
