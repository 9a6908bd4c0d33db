#!/usr/bin/env bash
# Brings more than one device call may carry (64 MiB with the working tree) to the GPU machine: packed here into
# numbered chunks, carried one per call on the WARM machine (/tmp survives between calls while it stays warm; it
# goes back after ~30 s idle, so make the calls back to back), unpacked and installed there at the last chunk.
#
#   here:   bash bench/gpu_carry.sh pack DIR PATH...     # tar of PATHs -> DIR/chunk.1..N (<= 48 MiB each) + DIR/sha256
#   then, for k = 1..N, one device call each:
#           rm -rf .carry && mkdir .carry && cp DIR/chunk.k DIR/sha256 .carry/     (here, before the call)
#           run(carry=[".carry"], command="bash bench/gpu_carry.sh land k N && ...")
#   there:  land k N  copies .carry/chunk.k to /tmp/carry/; at k = N it checks the sha256 of the joined chunks,
#           unpacks them under /tmp/carry/files and pip-installs every wheel found there into /tmp/site
#           (then: export PYTHONPATH=/tmp/site:$PYTHONPATH).
set -euo pipefail
CHUNK_MIB=${CHUNK_MIB:-48}  # with the working tree (~10 MiB) under the 64 MiB a call carries
cmd=${1:-}
case "$cmd" in
  pack)
    dir=$2; shift 2
    rm -rf "$dir" && mkdir -p "$dir"
    tar -cf "$dir/all.tar" "$@"
    # chunk.1, chunk.2, ...: numbered as the calls that carry them
    (cd "$dir" && sha256sum all.tar | cut -d' ' -f1 > sha256 \
      && split -b "${CHUNK_MIB}M" --numeric-suffixes=1 -a 1 all.tar chunk. && rm all.tar)
    n=$(ls "$dir"/chunk.* | wc -l)
    echo "packed $(du -sh "$dir" | cut -f1) into $n chunks in $dir: carry them with 'land k $n', k = 1..$n"
    ;;
  land)
    k=$2; n=$3
    [ -f ".carry/chunk.$k" ] || { echo "error: .carry/chunk.$k was not carried: copy DIR/chunk.$k into .carry/ and" \
      "pass carry=[\".carry\"]" >&2; exit 2; }
    mkdir -p /tmp/carry && cp ".carry/chunk.$k" /tmp/carry/ && cp .carry/sha256 /tmp/carry/
    have=$(ls /tmp/carry/chunk.* | wc -l)
    echo "landed chunk $k of $n ($have on this machine)"
    if [ "$k" = "$n" ]; then
      missing=""; for i in $(seq 1 "$n"); do [ -f "/tmp/carry/chunk.$i" ] || missing="$missing $i"; done
      [ -z "$missing" ] || { echo "error: chunks$missing are not on this machine (it went back between calls?):" \
        "carry them again, back to back" >&2; exit 2; }
      got=$(for i in $(seq 1 "$n"); do cat "/tmp/carry/chunk.$i"; done | sha256sum | cut -d' ' -f1)
      [ "$got" = "$(cat /tmp/carry/sha256)" ] || { echo "error: the joined chunks' sha256 differs from the packed" \
        "one: pack again and carry every chunk" >&2; exit 2; }
      rm -rf /tmp/carry/files && mkdir -p /tmp/carry/files
      for i in $(seq 1 "$n"); do cat "/tmp/carry/chunk.$i"; done | tar -xf - -C /tmp/carry/files
      wheels=$(find /tmp/carry/files -type f -name '*.whl' | sort)
      if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086  # one argument per wheel
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $wheels
      fi
      echo "unpacked under /tmp/carry/files; $(echo "$wheels" | grep -c whl) wheels in /tmp/site"
    fi
    ;;
  *)
    echo "error: usage: bash bench/gpu_carry.sh pack DIR PATH... | land K N" >&2; exit 2 ;;
esac
