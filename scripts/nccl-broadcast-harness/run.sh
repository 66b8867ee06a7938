#!/bin/sh
# Rebuild tests/data/nccl/broadcast-<version>.json and allgather-<version>.json: NCCL's own
# broadcast and allgather partition and chunking, compiled from each tag (docs/NCCL.md section 6). Usage: run.sh <nccl git dir>
# (e.g. the directory `fetch github:NVIDIA/nccl` gives). Builds in a temporary directory;
# the NCCL code it cuts out is never written into this repository.
set -e
nccl=$1; here=$(cd "$(dirname "$0")" && pwd); out=$here/../../tests/data/nccl
work=$(mktemp -d); cp "$here"/gen.py "$here"/gendev.py "$here"/genold.py "$here"/stubs.h "$here"/stubs_old.h \
  "$here"/driver.inc "$here"/driver_old.inc "$here"/mk.py "$work"
cd "$work"
OLD="v2.14.3-1 v2.16.5-1 v2.17.1-1 v2.18.6-1 v2.19.4-1 v2.20.5-1 v2.21.5-1"
NEW="v2.22.3-1 v2.23.4-1 v2.24.3-1 v2.25.1-1 v2.26.6-1 v2.27.7-1 v2.28.9-1 v2.29.7-1 v2.30.7-1"
for t in $OLD; do
  # 2.14-2.18 keep the device code in src/collectives/device, 2.19+ in src/device; 2.20 brings addCBDCollToPlan
  mkdir "src-$t"; dev=src/device; flags=""
  case $t in v2.1[4-8].*) dev=src/collectives/device ;; esac
  case $t in v2.2[01].*) flags="-DCBD" ;; esac
  for f in primitives.h broadcast.h all_gather.h; do git -C "$nccl" show "$t:$dev/$f" > "src-$t/$f"; done
  git -C "$nccl" show "$t:src/enqueue.cc" > "src-$t/enqueue.cc"
  python3 genold.py "src-$t" > "ext-$t.cc"
  { echo '#include "stubs_old.h"'; cat "ext-$t.cc"; cat driver_old.inc; } > "h-$t.cc"
  g++ -std=c++17 -O1 -w -I. $flags -o "h-$t" "h-$t.cc"
done
for t in $NEW; do
  git -C "$nccl" show "$t:src/enqueue.cc" > "enq-$t.cc"
  git -C "$nccl" show "$t:src/include/device.h" > "dev-$t.h"
  python3 gen.py "enq-$t.cc" > "ext-$t.cc"
  flags=""
  case $t in v2.22.*) ;; v2.23.*|v2.24.*|v2.25.*) flags="-DTASK_MIN_TRAFFIC" ;; *) flags="-DTASK_MIN_TRAFFIC -DLL_TRAFFIC_X4" ;; esac
  { echo '#include "stubs.h"'; python3 gendev.py "dev-$t.h"; cat "ext-$t.cc"; cat driver.inc; } > "h-$t.cc"
  g++ -std=c++17 -O1 -w -I. $flags -o "h-$t" "h-$t.cc"
done
python3 mk.py "$out" $OLD $NEW
