#!/bin/bash
# A real 2-node Slurm 22.05 cluster on one Debian 12 host (root), for the tests of slurm/*.sh.
# n1, n2 = slurmd in their own network+UTS namespaces on a private bridge;
# slurmctld (and sbatch/squeue) in the host namespace on the bridge address.
set -euo pipefail
LAB=${LAB:-${TMPDIR:-/tmp}/slurm-test-cluster}       # state, spool, logs, pid files
NET=${NET:-10.231.77}               # /24 used only on slbr0 inside this machine
CONF=$LAB/slurm.conf
export DEBIAN_FRONTEND=noninteractive
command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null ||
  { apt-get update -qq; apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }
mkdir -p "$LAB"/{state,spool/n1,spool/n2,run,log}

# --- munge (one munged; its unix socket is shared by all namespaces) ---
[ -s /etc/munge/munge.key ] || { mungekey -c; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
install -d -o munge -g munge -m 755 /run/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$LAB/run/munged.pid"       # remember we own it
fi

# --- network: bridge on the host + one netns per node ---
ip link add slbr0 type bridge
ip addr add "$NET.1/24" dev slbr0
ip link set slbr0 up
for i in 1 2; do
  ip netns add slnode$i
  ip link add slv$i type veth peer name eth0 netns slnode$i
  ip link set slv$i master slbr0 up
  ip -n slnode$i addr add "$NET.1$i/24" dev eth0      # no default route: nothing leaves
  ip -n slnode$i link set eth0 up
  ip -n slnode$i link set lo up
  grep -q " n$i # slurm-test-cluster" /etc/hosts || echo "$NET.1$i n$i # slurm-test-cluster" >> /etc/hosts
done
# Docker leaves FORWARD policy DROP + bridge-nf-call-iptables=1 -> n1<->n2 would be dropped.
if command -v iptables >/dev/null && iptables -S FORWARD >/dev/null 2>&1; then
  iptables -I FORWARD 1 -i slbr0 -o slbr0 -j ACCEPT
fi

# --- slurm.conf ---
cat > "$CONF" <<EOF
ClusterName=ci
SlurmctldHost=$(hostname -s)($NET.1)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$LAB/run/slurmctld.pid
SlurmdPidFile=$LAB/run/slurmd-%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
EnforcePartLimits=ALL
MailProg=/bin/true
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=n1 NodeAddr=$NET.11 CPUs=2 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeAddr=$NET.12 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
[ -e /etc/slurm/slurm.conf ] || ln -s "$CONF" /etc/slurm/slurm.conf   # so plain sbatch finds it
export SLURM_CONF=$CONF

# --- daemons ---
/usr/sbin/slurmctld -f "$CONF" -i
for i in 1 2; do
  # nsenter (not `ip netns exec`, which remounts /sys and hides /sys/fs/cgroup -> slurmd dies)
  nsenter --net=/run/netns/slnode$i unshare --uts \
    sh -c "hostname n$i && exec /usr/sbin/slurmd -f '$CONF' -N n$i"
done
for _ in $(seq 300); do
  [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = 2 ] && break; sleep 0.2
done
sinfo
[ "$(sinfo -h -N -t idle -o %N | sort -u | wc -l)" = 2 ] || { echo "nodes not idle"; tail -n 20 "$LAB"/log/*.log; exit 1; }
