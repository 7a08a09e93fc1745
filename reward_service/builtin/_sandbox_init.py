"""Sandbox launcher: runs as root inside fresh namespaces made by ``unshare`` (network, mount, PID,
IPC, UTS), builds a minimal root file system, drops to an unprivileged user and runs the program.

    unshare --net --mount --pid --ipc --uts --fork --kill-child -- PYTHON -I -S -B _sandbox_init.py SPEC_JSON

Standard library only (it runs under ``python -I -S``, outside any virtual environment).

The program sees: a tmpfs root; read-only binds of /usr, the Python installation and the
``ro_paths`` given; /dev/null, /dev/zero, /dev/urandom; a writable /sandbox holding the files of
``src``; a private /tmp. Nothing else of the host: no /etc, no /home, no /root, no /proc, no /work.
Its network namespace has only a loopback interface that is down: every connection fails.
It runs as the uid (and gid) of ``spec["uid"]``, leased for this run alone (sandbox_uids.py: no other
process of the host has it, so none can ptrace or signal the program), with no capabilities, under rlimits
(CPU, address space, file size, open files, and processes when there is no cgroup) and a scrubbed
environment. Before anything else
this launcher joins the run's cgroups (``cgroup_procs``), so everything below it counts against
their memory and pids limits. This process stays as PID 1 of the namespace:
when it exits, the kernel kills everything the program left behind.
Exit status 125 with a message on stderr means the sandbox itself could not be set up.
"""

import ctypes
import json
import os
import resource
import shutil
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
MS_PRIVATE = 1 << 18

libc = ctypes.CDLL(None, use_errno=True)


def mount(src, target, fstype, flags, data=None):
    if (
        libc.mount(
            src.encode() if src else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} -> {target}: {os.strerror(err)}")


def bind_ro(root, path):
    target = root + path
    if os.path.islink(path):  # merged-/usr layouts: /lib -> usr/lib
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(path, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def setup(spec):
    root, uid = spec["root"], spec["uid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_mb']}m,mode=755")
    for p in ["/usr", "/bin", "/lib", "/lib64", "/sbin", *spec["ro_paths"]]:
        if os.path.lexists(p) and not os.path.lexists(root + p):
            bind_ro(root, p)
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
        bind_ro(root, dev)
        mount(None, root + dev, None, MS_REMOUNT | MS_BIND | MS_NOSUID)  # writable (for /dev/null), still nosuid
    for d in ("sandbox", "tmp"):
        os.makedirs(f"{root}/{d}")
        os.chown(f"{root}/{d}", uid, uid)
    os.chmod(f"{root}/tmp", 0o1777)
    for name in os.listdir(spec["src"]):
        shutil.copyfile(os.path.join(spec["src"], name), f"{root}/sandbox/{name}")
        os.chown(f"{root}/sandbox/{name}", uid, uid)
    os.chroot(root)
    os.chdir("/sandbox")


def limit(spec):
    mem = spec["memory_mb"] * 2**20
    for res, val in (
        (resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_FSIZE, (spec["disk_mb"] * 2**20,) * 2),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, val)
    if spec["max_procs"] is not None:  # no cgroup: a per-user count, this run's alone (its own uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_procs"],) * 2)


def main():
    spec = json.loads(sys.argv[1])
    try:
        for procs in spec["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")  # this process; its children inherit the cgroup
        setup(spec)
    except OSError as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
            limit(spec)
            env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
            os.execve(spec["argv"][0], spec["argv"], env)
        except OSError as e:
            print(f"sandbox setup failed: {e}", file=sys.stderr)
            os._exit(125)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
