#!/usr/bin/env bash
# Install the Debian packages the integration tests need: Slurm's daemons and munge (the Slurm tests), and
# libfuse3 (a flaky mounted file system standing in for a busy NFS share).
# Idempotent; run as root.  The tests call it themselves when slurmctld is missing.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
   && command -v munged >/dev/null && command -v mungekey >/dev/null && command -v fusermount3 >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_slurm.sh: needs root to apt-get install slurmctld slurmd slurm-client munge fuse3" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge fuse3
