# Network for a two-node test cluster on one machine; sourced by cluster.sh.
#
# A bridge on the host holds the controller's address; each node is a network
# namespace joined to the bridge by a veth pair, with an address of its own and
# its name in /etc/hosts (between marker lines, removed again by netns_down).
# Only private addresses that exist inside these namespaces are used.
# shellcheck shell=bash

NET=10.213.77            # a private /24 that only these namespaces use
CTLD_ADDR=$NET.1         # the bridge: slurmctld as the nodes see it
BRIDGE=e3slurm0
NODE_NAMES=(e3node1 e3node2)
HOSTS_BEGIN="# echelon3 test cluster: begin"
HOSTS_END="# echelon3 test cluster: end"

node_ns() { echo "e3slurm-$1"; }                 # namespace of node NAME
node_addr() { echo "$NET.$((10 + $1))"; }        # address of node number N (1-based)

# Why two nodes cannot run here, or nothing.
netns_unsupported() {
    local cmd
    for cmd in ip nsenter unshare; do
        command -v "$cmd" >/dev/null 2>&1 || { echo "'$cmd' is not installed"; return 0; }
    done
    ip netns add e3slurm-probe 2>/dev/null || { echo "'ip netns add' fails here"; return 0; }
    ip netns del e3slurm-probe 2>/dev/null
    unshare --uts true 2>/dev/null || { echo "'unshare --uts' fails here"; return 0; }
    return 0
}

hosts_remove() {
    grep -qxF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null || return 0
    local kept
    kept=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" \
        '$0 == b {skip = 1; next} $0 == e {skip = 0; next} !skip' /etc/hosts)
    # in place: /etc/hosts may be a bind mount that cannot be replaced by a rename
    printf '%s\n' "$kept" >/etc/hosts
}

hosts_add() {
    hosts_remove
    local i lines=("$HOSTS_BEGIN")
    for i in "${!NODE_NAMES[@]}"; do
        lines+=("$(node_addr $((i + 1))) ${NODE_NAMES[$i]}")
    done
    lines+=("$HOSTS_END")
    printf '%s\n' "${lines[@]}" >>/etc/hosts
}

# Kill what still runs inside the namespaces (job steps of a node whose slurmd
# is gone), then delete namespaces, links and bridge, and the hosts lines.
netns_down() {
    local name ns pids i
    for name in "${NODE_NAMES[@]}"; do
        ns=$(node_ns "$name")
        [[ -e /run/netns/$ns ]] || continue
        for ((i = 0; i < 50; i++)); do
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [[ -z $pids ]] && break
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
            sleep 0.1
        done
        ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
    done
    for i in "${!NODE_NAMES[@]}"; do
        ip link del "e3v$((i + 1))" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    hosts_remove
}

netns_up() {
    netns_down
    ip link add "$BRIDGE" type bridge || return 1
    ip addr add "$CTLD_ADDR/24" dev "$BRIDGE" || return 1
    ip link set "$BRIDGE" up || return 1
    local i ns
    for i in "${!NODE_NAMES[@]}"; do
        ns=$(node_ns "${NODE_NAMES[$i]}")
        ip netns add "$ns" || return 1
        ip link add "e3v$((i + 1))" type veth peer name "e3p$((i + 1))" || return 1
        ip link set "e3v$((i + 1))" master "$BRIDGE" up || return 1
        ip link set "e3p$((i + 1))" netns "$ns" || return 1
        nsenter --net="/run/netns/$ns" ip link set "e3p$((i + 1))" name eth0 || return 1
        nsenter --net="/run/netns/$ns" ip addr add "$(node_addr $((i + 1)))/24" dev eth0 || return 1
        nsenter --net="/run/netns/$ns" ip link set eth0 up || return 1
        nsenter --net="/run/netns/$ns" ip link set lo up || return 1
    done
    hosts_add
}

# start_node_slurmd NAME PORT: slurmd as node NAME, in its namespace, with its own
# host name (UTS namespace). nsenter, not `ip netns exec`: the latter remounts
# /sys, which hides /sys/fs/cgroup from slurmd.
start_node_slurmd() {
    local name=$1 port=$2
    nsenter --net="/run/netns/$(node_ns "$name")" unshare --uts \
        sh -c "hostname '$name' && exec slurmd -N '$name' --conf-server '$CTLD_ADDR:$port'" >&2
}
