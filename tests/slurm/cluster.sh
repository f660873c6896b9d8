#!/usr/bin/env bash
# A real SLURM cluster on this machine, for tests: two nodes where network
# namespaces work (SLURM_TEST_NODES=1 asks for one), else one node on localhost.
#
#   cluster.sh up DIR     install (if missing) and start munge, slurmctld and a
#                         slurmd per node; config, state, spool, logs, pid files
#                         and two fake GPUs per node all live under DIR; prints
#                         NODES=<names> and, last, SLURM_CONF=... on stdout.
#   cluster.sh down DIR   cancel leftover jobs, stop the daemons (munged too when
#                         `up` started it), delete namespaces, links and bridge,
#                         and take the node names out of /etc/hosts again.
#
# Two nodes: slurmctld on the host at the bridge address, each slurmd in its own
# network namespace (its address) and UTS namespace (its host name); see netns.sh.
#
# Needs root (apt-get, mknod, daemons). Exit codes: 0 ok, 1 failure (daemon
# logs on stderr), 2 usage, 3 "cannot run here" (not root, apt-get failed):
# callers treat 3 as a reason to skip, anything else as an error.
#
# Only one such cluster runs at a time (the daemons use the default ports);
# RECORD remembers the running one so that `up` can stop it first, even when
# its DIR has been deleted since.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin

RECORD=/run/echelon3-test-slurm.record
# shellcheck source=tests/slurm/netns.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns.sh"
NODES=()       # node names of the cluster being brought up
MUNGED_PID=""  # set when `up` started munged (so `down` stops it)
PACKAGES=(slurmctld slurmd slurm-client munge)
CLIENT_TOOLS=(srun sbatch salloc squeue sacct scontrol scancel sinfo sstat)
SYSTEM_PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
UP_TIMEOUT_S=${SLURM_TEST_UP_TIMEOUT_S:-60}

die() { echo "cluster.sh: $*" >&2; exit 1; }
skip() { echo "cluster.sh: SKIP: $*" >&2; exit 3; }
log() { echo "cluster.sh: $*" >&2; }

# --- processes ---------------------------------------------------------------

# pid_alive PID NAME: PID exists and its command name is NAME (guards against
# a stale pid file pointing at a reused pid).
pid_alive() {
    local pid=$1 name=$2
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    # a zombie has exited already (the daemons' first fork may be left
    # unreaped where PID 1 does not reap)
    local state
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]]
}

# stop_pid PID NAME: SIGTERM, wait up to 15 s, then SIGKILL.
stop_pid() {
    local pid=$1 name=$2 i
    pid_alive "$pid" "$name" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        pid_alive "$pid" "$name" || return 0
        sleep 0.1
    done
    log "$name ($pid) ignored SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
}

read_pid() { [[ -r $1 ]] && tr -dc '0-9' <"$1" || true; }

# --- packages and munge --------------------------------------------------------

ensure_packages() {
    local missing=0 cmd
    for cmd in slurmctld slurmd sbatch srun squeue scontrol sinfo scancel munged munge unmunge; do
        command -v "$cmd" >/dev/null 2>&1 || missing=1
    done
    ((missing)) || return 0
    command -v apt-get >/dev/null 2>&1 || skip "SLURM is not installed and apt-get is not available"
    log "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    local opts=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    if ! apt-get install "${opts[@]}" "${PACKAGES[@]}" >&2; then
        apt-get update -q >&2 || skip "apt-get update failed"
        apt-get install "${opts[@]}" "${PACKAGES[@]}" >&2 || skip "apt-get install ${PACKAGES[*]} failed"
    fi
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

ensure_munge() {
    munge_works && return 0
    id munge >/dev/null 2>&1 || die "user 'munge' does not exist (broken munge package?)"
    [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (broken munge package?)"
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    # A stale pid file from a crashed munged makes the new one refuse to start.
    local pid
    pid=$(read_pid /run/munge/munged.pid)
    [[ -n $pid ]] && ! pid_alive "$pid" munged && rm -f /run/munge/munged.pid
    runuser -u munge -- munged >&2 || die "munged failed to start"
    local i
    for ((i = 0; i < 50; i++)); do
        if munge_works; then
            MUNGED_PID=$(read_pid /run/munge/munged.pid)
            return 0
        fi
        sleep 0.1
    done
    die "munged started but 'munge -n | unmunge' fails"
}

# --- configuration -------------------------------------------------------------

# node_lines DIR CPUS MEM: NodeName lines of slurm.conf, then a line "--", then
# the lines of gres.conf, for the nodes in NODES; fake GPUs are per node.
node_lines() {
    local dir=$1 cpus=$2 mem=$3 i g name addr gres=()
    for i in "${!NODES[@]}"; do
        name=${NODES[$i]}
        addr=127.0.0.1
        ((${#NODES[@]} > 1)) && addr=$(node_addr $((i + 1)))
        install -d -m 755 "$dir/dev/$name"
        # The fake GPUs must be character devices; SLURM rejects plain files.
        for g in 0 1; do
            [[ -c $dir/dev/$name/fakegpu$g ]] || mknod -m 666 "$dir/dev/$name/fakegpu$g" c 1 3
        done
        echo "NodeName=$name NodeAddr=$addr CPUs=$cpus RealMemory=$mem Gres=gpu:2 State=UNKNOWN"
        gres+=("NodeName=$name Name=gpu File=$dir/dev/$name/fakegpu[0-1]")
    done
    echo "--"
    printf '%s\n' "${gres[@]}"
}

write_config() {
    local dir=$1 host ctld_addr=127.0.0.1 cpus mem_avail real_mem def_mem nodes lines
    host=$(hostname -s)
    ((${#NODES[@]} > 1)) && ctld_addr=$CTLD_ADDR
    # CPUs are only scheduling tokens here (no cgroups, no binding); two at
    # least, so that two one-CPU tasks fit on a one-core machine too, and more
    # per node with two nodes, so that several small 2-node jobs run at once.
    cpus=$(nproc)
    ((cpus >= 2)) || cpus=2
    ((${#NODES[@]} > 1)) && cpus=$((cpus * 3))
    mem_avail=$(free -m | awk '/^Mem:/ {print $7}')
    real_mem=$((mem_avail * 9 / 10 / ${#NODES[@]}))
    def_mem=$((real_mem / cpus / 2))
    ((def_mem > 1024)) && def_mem=1024

    install -d -m 755 "$dir/etc" "$dir/dev" "$dir/log" "$dir/run"
    install -d -o slurm -g slurm -m 755 "$dir/state" "$dir/log/ctld" "$dir/run/ctld"
    install -d -m 755 "$dir/spool"
    lines=$(node_lines "$dir" "$cpus" "$real_mem")
    nodes=$(IFS=,; echo "${NODES[*]}")

    cat >"$dir/etc/slurm.conf" <<EOF
# Generated by tests/slurm/cluster.sh; ${#NODES[@]} node(s), no accounting.
ClusterName=echelon3test
SlurmctldHost=$host($ctld_addr)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# configless: slurmd fetches this file from slurmctld; clients use the
# wrappers in bin/, which set SLURM_CONF
SlurmctldParameters=enable_configless
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/ctld/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/ctld/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
MinJobAge=300
# start batch jobs at the next scheduler pass (about 1 s), not up to 3 s later
SchedulerParameters=batch_sched_delay=0
KillWait=5
InactiveLimit=0
Waittime=0
DefMemPerCPU=$def_mem
${lines%%$'\n'--*}
PartitionName=main Nodes=$nodes Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/etc/gres.conf" <<EOF
AutoDetect=off
${lines#*$'\n'--$'\n'}
EOF
    chmod 644 "$dir/etc/slurm.conf" "$dir/etc/gres.conf"

    cat >"$dir/env.sh" <<EOF
export SLURM_CONF=$dir/etc/slurm.conf
export PATH=$dir/bin:\$PATH
EOF
    write_client_wrappers "$dir"
}

# write_client_wrappers DIR: DIR/bin/<tool> runs the real client with this cluster's
# SLURM_CONF, whatever the environment or /etc/slurm holds. Jobs inherit PATH
# (--export=ALL), and Snakemake's jobstep executor strips SLURM_CONF, not PATH,
# before its inner srun, so every client call of the tests, inside jobs too, reaches
# this cluster.
write_client_wrappers() {
    local dir=$1 tool real
    install -d -m 755 "$dir/bin"
    for tool in "${CLIENT_TOOLS[@]}"; do
        real=$(PATH=$SYSTEM_PATH command -v "$tool") || continue
        printf '#!/bin/sh\n# Generated by tests/slurm/cluster.sh\nSLURM_CONF=%s exec %s "$@"\n' \
            "$dir/etc/slurm.conf" "$real" >"$dir/bin/$tool"
        chmod 755 "$dir/bin/$tool"
    done
}

# --- up / down ----------------------------------------------------------------

dump_logs() {
    local dir=$1 f
    for f in "$dir/log/ctld/slurmctld.log" "$dir"/log/slurmd*.log; do
        echo "----- $f (last 40 lines) -----" >&2
        tail -n 40 "$f" >&2 2>/dev/null || echo "(missing)" >&2
    done
    echo "----- scontrol show node -----" >&2
    scontrol show node >&2 2>&1 || true
}

ctld_port() { timeout 10 scontrol show config 2>/dev/null | awk '$1 == "SlurmctldPort" {print $3; exit}'; }

wait_ctld() {
    local dir=$1 deadline
    deadline=$((SECONDS + UP_TIMEOUT_S))
    while ((SECONDS < deadline)); do
        timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP' && return 0
        sleep 0.2
    done
    log "slurmctld does not answer after ${UP_TIMEOUT_S}s"
    dump_logs "$dir"
    exit 1
}

# The scheduler's first pass comes about 3 s after slurmctld starts; a job
# submitted before it waits for it, and `sbatch --wait` (polling at growing
# intervals) then returns some 8 s late. The pass logs its parameters.
wait_scheduler() {
    local i
    for ((i = 0; i < 100; i++)); do
        grep -q 'SchedulerParameters=' "$1/log/ctld/slurmctld.log" 2>/dev/null && return 0
        sleep 0.1
    done
}

wait_idle() {
    local dir=$1 states idle deadline
    deadline=$((SECONDS + UP_TIMEOUT_S))
    while ((SECONDS < deadline)); do
        # a node that is down at first contact returns by itself
        # (ReturnToService=2), so only the deadline ends the wait
        states=$(timeout 10 sinfo -h -N -o '%N=%T' 2>/dev/null || true)
        idle=$(grep -c '=idle$' <<<"$states" || true)
        if ((idle == ${#NODES[@]})); then
            wait_scheduler "$dir"
            return 0
        fi
        sleep 0.5
    done
    log "nodes not idle after ${UP_TIMEOUT_S}s (states: '${states:-no answer}')"
    dump_logs "$dir"
    exit 1
}

# drop_conf_link DIR: remove slurmd's /run/slurm/conf link if it leads into DIR
drop_conf_link() {
    local target
    [[ -n $1 && -L /run/slurm/conf ]] || return 0
    target=$(readlink /run/slurm/conf)
    [[ $target == "$1"/* ]] && rm -f /run/slurm/conf
    return 0
}

cancel_jobs() {
    local ids i
    ids=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
    [[ -n $ids ]] || return 0
    # shellcheck disable=SC2086
    timeout 10 scancel $ids 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        [[ -z $(timeout 10 squeue -h -o %A 2>/dev/null || true) ]] && return 0
        sleep 0.2
    done
    log "jobs still listed after scancel: $ids"
}

# stop_cluster DIR: cancel its jobs, stop its slurmds and slurmctld (pids from
# its pid files, else from RECORD), munged when `up` started it, then remove
# namespaces, links, bridge and /etc/hosts lines. DIR may be gone already.
stop_cluster() {
    local dir=$1 ctld="" munged="" pid f ours=0
    local slurmds=()
    [[ -r $RECORD && $(sed -n 's/^dir=//p' "$RECORD") == "$dir" ]] && ours=1
    ctld=$(read_pid "$dir/run/ctld/slurmctld.pid")
    for f in "$dir"/run/slurmd*.pid; do
        [[ -r $f ]] && slurmds+=("$(read_pid "$f")")
    done
    if ((ours)); then
        [[ -n $ctld ]] || ctld=$(sed -n 's/^slurmctld=//p' "$RECORD")
        while read -r pid; do slurmds+=("$pid"); done < <(sed -n 's/^slurmd[^=]*=//p' "$RECORD")
        munged=$(sed -n 's/^munged=//p' "$RECORD")
    fi
    if pid_alive "$ctld" slurmctld && [[ -r $dir/etc/slurm.conf ]]; then
        SLURM_CONF=$dir/etc/slurm.conf cancel_jobs
    fi
    for pid in "${slurmds[@]}"; do
        stop_pid "$pid" slurmd
    done
    stop_pid "$ctld" slurmctld
    netns_down
    drop_conf_link "$dir"
    [[ -n $munged ]] && stop_pid "$munged" munged
    ((ours)) && rm -f "$RECORD"
    return 0
}

stop_recorded() {
    [[ -r $RECORD ]] || return 0
    local dir
    dir=$(sed -n 's/^dir=//p' "$RECORD")
    log "stopping what is left of the cluster from $dir"
    stop_cluster "$dir"
    rm -f "$RECORD"
}

# record DIR KEY NAME PIDFILE: wait for the daemon's pid file and add KEY=pid to
# RECORD, at once, so that a failed bring-up can still be stopped later.
record() {
    local dir=$1 key=$2 name=$3 pidfile=$4 pid="" i
    for ((i = 0; i < 50; i++)); do
        pid=$(read_pid "$pidfile")
        [[ -n $pid ]] && break
        sleep 0.1
    done
    printf '%s=%s\n' "$key" "$pid" >>"$RECORD"
    pid_alive "$pid" "$name" || { dump_logs "$dir"; die "$name ($key) is not running"; }
}

# choose_nodes: two nodes in namespaces where that works, else this host alone
# (then says why on stdout, for the test fixture's skip reason).
choose_nodes() {
    NODES=("$(hostname -s)")
    [[ ${SLURM_TEST_NODES:-2} == 1 ]] && return 0
    local reason
    reason=$(netns_unsupported)
    if [[ -z $reason ]]; then
        netns_up && { NODES=("${NODE_NAMES[@]}"); return 0; }
        reason="setting up the network namespaces failed"
    fi
    netns_down
    log "one node only: $reason"
    echo "ONE_NODE_REASON=$reason"
}

start_slurmds() {
    local dir=$1 port name
    port=$(ctld_port)
    for name in "${NODES[@]}"; do
        if ((${#NODES[@]} == 1)); then
            slurmd --conf-server "127.0.0.1:$port" >&2 || { dump_logs "$dir"; die "slurmd failed to start"; }
        else
            start_node_slurmd "$name" "$port" || { dump_logs "$dir"; die "slurmd of $name failed to start"; }
        fi
        record "$dir" "slurmd:$name" slurmd "$dir/run/slurmd-$name.pid"
    done
}

cmd_up() {
    local dir=$1
    ((EUID == 0)) || skip "needs root to install and start the SLURM daemons"
    [[ $(uname -s) == Linux ]] || skip "needs Linux"
    ensure_packages
    id slurm >/dev/null 2>&1 || die "user 'slurm' does not exist (broken slurm packages?)"
    stop_recorded
    ensure_munge

    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd -P)
    printf 'dir=%s\n' "$dir" >"$RECORD"
    [[ -n $MUNGED_PID ]] && printf 'munged=%s\n' "$MUNGED_PID" >>"$RECORD"
    # slurmctld runs as 'slurm' and must reach its state dir and the config.
    chmod 755 "$dir"
    runuser -u slurm -- test -r "$dir" -a -x "$dir" \
        || die "user 'slurm' cannot enter $dir (a parent folder is not world-executable)"
    choose_nodes
    write_config "$dir"
    export SLURM_CONF=$dir/etc/slurm.conf

    slurmctld -f "$SLURM_CONF" >&2 || { dump_logs "$dir"; die "slurmctld failed to start"; }
    record "$dir" slurmctld slurmctld "$dir/run/ctld/slurmctld.pid"
    wait_ctld "$dir"
    start_slurmds "$dir"

    wait_idle "$dir"
    log "cluster up: $(sinfo -h -o '%P %D %T %G' | tr '\n' ' ')"
    echo "NODES=$(IFS=,; echo "${NODES[*]}")"
    echo "SLURM_CONF=$SLURM_CONF"
}

cmd_down() {
    local dir=$1
    [[ -d $dir ]] && dir=$(cd "$dir" && pwd -P)
    stop_cluster "$dir"
}

main() {
    [[ $# -eq 2 && ($1 == up || $1 == down) ]] || {
        echo "usage: $0 up|down DIR" >&2
        exit 2
    }
    "cmd_$1" "$2"
}

main "$@"
