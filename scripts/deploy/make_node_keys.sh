#!/usr/bin/env bash
# Make one authentication key pair per SuperNode (ECDSA P-384, OpenSSH format, as Flower expects).
#
#   scripts/deploy/make_node_keys.sh [-o DIR] [-f] NAME...
#   scripts/deploy/make_node_keys.sh [-o DIR] [-f] -c COUNT      # names node-0 ... node-<COUNT-1>
#
#   -o DIR     output folder (default: ./keys); created with mode 700
#   -c COUNT   make COUNT key pairs named node-0, node-1, ...
#   -f         overwrite existing key pairs (default: refuse)
#   -h         this help
#
# Writes for each NAME:
#   DIR/NAME      private key  SECRET - stays on that SuperNode machine:
#                              flower-supernode --auth-supernode-private-key DIR/NAME ...
#   DIR/NAME.pub  public key   given to whoever runs the SuperLink, who registers it:
#                              flwr supernode register DIR/NAME.pub <connection>
#
# Only registered public keys can join a SuperLink started with --enable-supernode-auth.
# Make each SuperNode's key on the SuperNode's own machine, and send only the .pub file.
# Uses ssh-keygen; without it, Python's `cryptography` package (a Flower dependency).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

out=keys
count=""
force=0
while getopts ":o:c:fh" opt; do
    case "$opt" in
        o) out=$OPTARG ;;
        c) count=$OPTARG ;;
        f) force=1 ;;
        h) usage; exit 0 ;;
        :) echo "make_node_keys.sh: -$OPTARG needs a value (see -h)" >&2; exit 2 ;;
        *) echo "make_node_keys.sh: unknown option -$OPTARG (see -h)" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
names=("$@")
if [ -n "$count" ]; then
    case "$count" in ''|*[!0-9]*) echo "make_node_keys.sh: -c needs a number" >&2; exit 2 ;; esac
    for ((i = 0; i < count; i++)); do names+=("node-$i"); done
fi
if [ ${#names[@]} -eq 0 ]; then
    echo "make_node_keys.sh: give node names or -c COUNT (see -h)" >&2
    exit 2
fi
for name in "${names[@]}"; do
    case "$name" in
        ''|.*|*[!A-Za-z0-9._-]*) echo "make_node_keys.sh: bad node name '$name' (letters, digits, . _ -)" >&2; exit 2 ;;
    esac
    if [ -e "$out/$name" ] && [ "$force" -ne 1 ]; then
        echo "make_node_keys.sh: $out/$name exists; use -f to overwrite" >&2
        exit 1
    fi
done

mkdir -p "$out"
chmod 700 "$out"
umask 077
python=${PYTHON:-python3}
for name in "${names[@]}"; do
    rm -f "$out/$name" "$out/$name.pub"
    if command -v ssh-keygen >/dev/null; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "$name" -f "$out/$name"
    else
        "$python" - "$out/$name" "$name" <<'EOF'
import sys
from pathlib import Path
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path, comment = Path(sys.argv[1]), sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()))
public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                       serialization.PublicFormat.OpenSSH)
path.with_name(path.name + ".pub").write_bytes(public + b" " + comment.encode() + b"\n")
EOF
    fi
    chmod 600 "$out/$name"
    chmod 644 "$out/$name.pub"
    echo "Wrote $out/$name (private) and $out/$name.pub (public)"
done
