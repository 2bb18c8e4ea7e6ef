#!/usr/bin/env bash
# Makes the certificates a moesnap job's daemons authenticate each other with (mutual TLS on the
# Peer service and the data plane), with openssl only:
#
#   make-certs.sh [--days N] [--ca-days N] [--etcd-ip IP]... DIR JOB NODE_COUNT
#
# In DIR (created mode 0700):
#   ca.pem, ca.key            the job's CA (EC P-256), made once and kept
#   node-<id>.pem, .key       one per node id 0 .. NODE_COUNT-1, signed by the CA, naming the job and
#                             the node: SAN URI moesnap://<JOB>/node/<id> (the identity a daemon
#                             checks) and DNS node-<id>.<JOB>.moesnap (the name a peer's client
#                             expects); usable as server and client certificate
#   etcd.pem, etcd.key        with --etcd-ip: a certificate for etcd members listening on those IP
#                             addresses (and 127.0.0.1), for etcd's --cert-file/--key-file, with
#                             --trusted-ca-file ca.pem and --client-cert-auth
# Keys are mode 0600. Running it again keeps every file that is still valid for the CA and the job
# (so it is safe to rerun, e.g. with a larger NODE_COUNT) and makes again only what is missing, was
# signed by another CA or names another job. --days N: validity of new node and etcd certificates
# (default 825); --ca-days N: of a new CA (default 8250). Copy ca.pem, node-<id>.pem and node-<id>.key to node <id> only; keep
# ca.key off the nodes.
set -euo pipefail

usage() {
  sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

days=825
ca_days=8250
etcd_ips=()
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --days) [[ $# -ge 2 ]] || usage; days=$2; shift 2 ;;
    --ca-days) [[ $# -ge 2 ]] || usage; ca_days=$2; shift 2 ;;
    --etcd-ip) [[ $# -ge 2 ]] || usage; etcd_ips+=("$2"); shift 2 ;;
    --help) usage ;;
    *) echo "make-certs.sh: unknown option $1" >&2; usage ;;
  esac
done
[[ $# -eq 3 ]] || usage
dir=$1 job=$2 node_count=$3
if [[ ! $job =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "make-certs.sh: job '$job' must be letters, digits, '-', '_' or '.' (as cluster.job)" >&2
  exit 2
fi
if [[ ! $node_count =~ ^[0-9]+$ || $node_count -lt 1 ]]; then
  echo "make-certs.sh: NODE_COUNT must be a positive integer, got '$node_count'" >&2
  exit 2
fi
if [[ ! $days =~ ^-?[0-9]+$ || ! $ca_days =~ ^[0-9]+$ ]]; then
  echo "make-certs.sh: --days must be an integer and --ca-days a positive one" >&2
  exit 2
fi

mkdir -p "$dir"
chmod 0700 "$dir"
cd "$dir"
umask 077
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

new_key() {  # new_key FILE
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
  chmod 0600 "$1"
}

if [[ ! -s ca.pem || ! -s ca.key ]]; then
  new_key ca.key
  openssl req -x509 -new -key ca.key -out ca.pem -days "$ca_days" -sha256 \
    -subj "/CN=moesnap job CA $job" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  chmod 0644 ca.pem
  echo "made the CA: $dir/ca.pem"
fi

# still_valid CERT SAN: signed by this CA, not expired, and carrying SAN (the job's name for it).
still_valid() {
  [[ -s $1 && -s ${1%.pem}.key ]] &&
    openssl verify -CAfile ca.pem "$1" >/dev/null 2>&1 &&
    openssl x509 -in "$1" -noout -ext subjectAltName 2>/dev/null | grep -qF "$2"
}

# issue NAME SUBJECT SAN: NAME.key and NAME.pem signed by the CA.
issue() {
  new_key "$1.key"
  openssl req -new -key "$1.key" -out "$scratch/$1.csr" -subj "$2" 2>/dev/null
  cat >"$scratch/$1.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$3
EOF
  openssl x509 -req -in "$scratch/$1.csr" -CA ca.pem -CAkey ca.key -days "$days" -sha256 \
    -set_serial "0x$(openssl rand -hex 16)" -extfile "$scratch/$1.ext" -out "$1.pem" 2>/dev/null
  chmod 0644 "$1.pem"
  echo "made $dir/$1.pem"
}

for ((id = 0; id < node_count; ++id)); do
  uri="URI:moesnap://$job/node/$id"
  if ! still_valid "node-$id.pem" "$uri"; then
    issue "node-$id" "/CN=node-$id.$job.moesnap" "$uri,DNS:node-$id.$job.moesnap"
  fi
done

if [[ ${#etcd_ips[@]} -gt 0 ]]; then
  san="DNS:localhost,IP:127.0.0.1"
  for ip in "${etcd_ips[@]}"; do san+=",IP:$ip"; done
  if ! still_valid etcd.pem "${etcd_ips[-1]}"; then
    issue etcd "/CN=etcd for moesnap job $job" "$san"
  fi
fi
