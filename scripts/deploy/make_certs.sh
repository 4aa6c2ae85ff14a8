#!/usr/bin/env bash
# Make a private certificate authority (CA) and a TLS certificate for the Flower SuperLink.
#
#   scripts/deploy/make_certs.sh [-o DIR] [-n DNS_NAME]... [-i IP]... [-d DAYS] [-k ec|rsa] [-f]
#
#   -o DIR       output folder (default: ./certificates); created with mode 700
#   -n NAME      a DNS name clients use to reach the SuperLink (repeatable), e.g. -n link.example.org
#   -i IP        an IP address clients use to reach the SuperLink (repeatable), e.g. -i 10.0.0.5
#   -d DAYS      validity of both certificates in days (default: 365)
#   -k ec|rsa    key type: ec = P-384 (default, fast), rsa = RSA 4096
#   -f           overwrite existing files in DIR (default: refuse)
#   -h           this help
#
# `localhost`, `127.0.0.1` and `::1` are always added to the certificate: the SuperLink starts its
# own SuperExec, which connects to the SuperLink over loopback and checks the certificate too (also
# when the SuperLink listens on 0.0.0.0). Add every other name or address that SuperNodes and the
# `flwr` CLI use in their `--superlink` / `address` - a name not in the certificate fails the TLS
# handshake.
#
# Writes into DIR:
#   ca.key      CA private key        SECRET - keep it off the machines; only needed to sign again
#   ca.crt      CA certificate        public - copy to every SuperNode (--root-certificates) and to
#                                     every machine running `flwr` (root-certificates in config.toml)
#   server.key  SuperLink private key SECRET - stays on the SuperLink machine (--ssl-keyfile)
#   server.pem  SuperLink certificate public - on the SuperLink machine (--ssl-certfile)
#   server.csr, server.ext            the signing request and its extensions (kept for reference)
#
# Nothing here belongs in git: the repository's .gitignore ignores /certificates/ and /.cluster/.
# Example (SuperLink reachable as link.example.org and 10.0.0.5):
#   scripts/deploy/make_certs.sh -o certificates -n link.example.org -i 10.0.0.5
#   flower-superlink --ssl-ca-certfile certificates/ca.crt --ssl-certfile certificates/server.pem \
#       --ssl-keyfile certificates/server.key --enable-supernode-auth --host 127.0.0.1 --port 9091 ...
#   (loopback, behind the proxy that forwards only the Fleet API: docs/DEPLOY.md, "Who can do what")
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

out=certificates
days=365
keytype=ec
force=0
names=()
ips=()
while getopts ":o:n:i:d:k:fh" opt; do
    case "$opt" in
        o) out=$OPTARG ;;
        n) names+=("$OPTARG") ;;
        i) ips+=("$OPTARG") ;;
        d) days=$OPTARG ;;
        k) keytype=$OPTARG ;;
        f) force=1 ;;
        h) usage; exit 0 ;;
        :) echo "make_certs.sh: -$OPTARG needs a value (see -h)" >&2; exit 2 ;;
        *) echo "make_certs.sh: unknown option -$OPTARG (see -h)" >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ $# -gt 0 ]; then
    echo "make_certs.sh: unexpected argument '$1' (see -h)" >&2
    exit 2
fi
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }
case "$days" in ''|*[!0-9]*) echo "make_certs.sh: -d must be a number of days" >&2; exit 2 ;; esac
case "$keytype" in
    ec) keyargs=(-algorithm EC -pkeyopt ec_paramgen_curve:P-384) ;;
    rsa) keyargs=(-algorithm RSA -pkeyopt rsa_keygen_bits:4096) ;;
    *) echo "make_certs.sh: -k must be ec or rsa" >&2; exit 2 ;;
esac
for name in ${names[@]+"${names[@]}"}; do
    case "$name" in
        ''|*[!A-Za-z0-9.*-]*) echo "make_certs.sh: '$name' is not a DNS name (IPs go to -i)" >&2; exit 2 ;;
    esac
done
for ip in ${ips[@]+"${ips[@]}"}; do
    case "$ip" in
        ''|*[!0-9A-Fa-f.:]*) echo "make_certs.sh: '$ip' is not an IP address" >&2; exit 2 ;;
    esac
done

mkdir -p "$out"
chmod 700 "$out"
for file in ca.key ca.crt server.key server.pem; do
    if [ -e "$out/$file" ] && [ "$force" -ne 1 ]; then
        echo "make_certs.sh: $out/$file exists; use -f to overwrite" >&2
        exit 1
    fi
done

# Subject Alternative Names: loopback always, then the given names and addresses (deduplicated).
san="DNS:localhost,IP:127.0.0.1,IP:::1"
for name in ${names[@]+"${names[@]}"}; do
    [ "$name" = localhost ] || san="$san,DNS:$name"
done
for ip in ${ips[@]+"${ips[@]}"}; do
    case "$ip" in 127.0.0.1|::1) ;; *) san="$san,IP:$ip" ;; esac
done
cn=${names[0]:-localhost}

umask 077
openssl genpkey "${keyargs[@]}" -out "$out/ca.key" 2>/dev/null
openssl req -x509 -new -key "$out/ca.key" -sha384 -days "$days" \
    -subj "/CN=FedACT Flower CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$out/ca.crt"

openssl genpkey "${keyargs[@]}" -out "$out/server.key" 2>/dev/null
openssl req -new -key "$out/server.key" -subj "/CN=$cn" -out "$out/server.csr"
cat > "$out/server.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EOF
openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -days "$days" -sha384 -extfile "$out/server.ext" \
    -out "$out/server.pem" 2>/dev/null
rm -f "$out/ca.srl"
chmod 600 "$out/ca.key" "$out/server.key"
chmod 644 "$out/ca.crt" "$out/server.pem"

openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null
echo "Wrote $out/{ca.key,ca.crt,server.key,server.pem} (valid $days days)"
echo "SuperLink certificate names: $san"
