//! The seccomp filter every sandboxed process runs under.
//!
//! runcell uses a deny list on top of the other layers (user namespace, no
//! capabilities, `no_new_privs`): each entry closes a kernel interface that
//! sandboxed code has no business using and that has a history of privilege
//! escalation bugs. Denied calls fail with `EPERM` (or `ENOSYS` where libc
//! must fall back, see `clone3`), so programs get an error, not a crash.
//! docs/SECURITY.md has the table with the reason for each entry.
//!
//! One filter is installed, in parts run in order:
//! 1. A guard that kills the process on a foreign architecture (32-bit
//!    `int 0x80` calls), refuses the x32 ABI (syscall numbers with bit 30
//!    set), so the deny list below cannot be bypassed with another ABI, and
//!    answers `clone3` with `ENOSYS`.
//! 2. A binary search over the system calls the deny list has rules for:
//!    any other call is allowed here, in a few comparisons.
//! 3. The deny list itself (built with seccompiler), which the calls it has
//!    rules for fall into.
//!
//! One program rather than two stacked filters: the kernel checks, copies
//! and compiles each installed filter, and runs every one of them on every
//! system call of every sandboxed process.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule,
};

/// Errors building or installing the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// The filter could not be compiled.
    #[error("The seccomp filter could not be built.")]
    Build(#[source] seccompiler::BackendError),
    /// The filter could not be installed.
    #[error("The seccomp filter could not be installed.")]
    Install(#[source] seccompiler::Error),
    /// The current architecture is not supported.
    #[error("Seccomp filtering is not supported on this architecture.")]
    Arch,
    /// The search ahead of the deny list has a jump too long for BPF.
    #[error("The seccomp filter's search over the denied calls is too long for BPF's jumps.")]
    TooLong,
}

/// Every namespace flag of clone(2)/unshare(2).
const NAMESPACE_FLAGS: [u64; 8] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    0x80, // CLONE_NEWTIME
];

/// Syscalls that are always refused, with the reason (mirrored in docs/SECURITY.md).
pub const DENIED: &[(&str, i64, &str)] = &[
    (
        "mount",
        libc::SYS_mount,
        "filesystem mounts: new views of the tree, fs bugs",
    ),
    (
        "umount2",
        libc::SYS_umount2,
        "unmounting could reveal what a mount hides",
    ),
    ("pivot_root", libc::SYS_pivot_root, "changing the root"),
    ("open_tree", libc::SYS_open_tree, "new mount API"),
    ("move_mount", libc::SYS_move_mount, "new mount API"),
    ("fsopen", libc::SYS_fsopen, "new mount API"),
    ("fsconfig", libc::SYS_fsconfig, "new mount API"),
    ("fsmount", libc::SYS_fsmount, "new mount API"),
    ("fspick", libc::SYS_fspick, "new mount API"),
    ("mount_setattr", libc::SYS_mount_setattr, "new mount API"),
    (
        "ptrace",
        libc::SYS_ptrace,
        "reading and steering other processes",
    ),
    (
        "process_vm_readv",
        libc::SYS_process_vm_readv,
        "reading other processes' memory",
    ),
    (
        "process_vm_writev",
        libc::SYS_process_vm_writev,
        "writing other processes' memory",
    ),
    (
        "bpf",
        libc::SYS_bpf,
        "eBPF verifier and JIT: a large kernel attack surface",
    ),
    (
        "perf_event_open",
        libc::SYS_perf_event_open,
        "perf: side channels and kernel bugs",
    ),
    (
        "keyctl",
        libc::SYS_keyctl,
        "kernel keyrings are not namespaced",
    ),
    (
        "add_key",
        libc::SYS_add_key,
        "kernel keyrings are not namespaced",
    ),
    (
        "request_key",
        libc::SYS_request_key,
        "kernel keyrings are not namespaced",
    ),
    (
        "kexec_load",
        libc::SYS_kexec_load,
        "replacing the running kernel",
    ),
    (
        "kexec_file_load",
        libc::SYS_kexec_file_load,
        "replacing the running kernel",
    ),
    ("reboot", libc::SYS_reboot, "rebooting the host"),
    ("init_module", libc::SYS_init_module, "loading kernel code"),
    (
        "finit_module",
        libc::SYS_finit_module,
        "loading kernel code",
    ),
    (
        "delete_module",
        libc::SYS_delete_module,
        "unloading kernel code",
    ),
    (
        "userfaultfd",
        libc::SYS_userfaultfd,
        "stalls the kernel at will; a staple of exploits",
    ),
    (
        "io_uring_setup",
        libc::SYS_io_uring_setup,
        "io_uring: large attack surface, bypasses seccomp",
    ),
    ("io_uring_enter", libc::SYS_io_uring_enter, "io_uring"),
    ("io_uring_register", libc::SYS_io_uring_register, "io_uring"),
    (
        "open_by_handle_at",
        libc::SYS_open_by_handle_at,
        "opens files by handle, outside the mount tree (the 'shocker' escape)",
    ),
    (
        "name_to_handle_at",
        libc::SYS_name_to_handle_at,
        "companion of open_by_handle_at",
    ),
    ("setns", libc::SYS_setns, "joining other namespaces"),
    ("acct", libc::SYS_acct, "host-wide process accounting"),
    ("swapon", libc::SYS_swapon, "host swap"),
    ("swapoff", libc::SYS_swapoff, "host swap"),
    (
        "syslog",
        libc::SYS_syslog,
        "kernel log: leaks kernel addresses",
    ),
    ("settimeofday", libc::SYS_settimeofday, "the host clock"),
    ("clock_settime", libc::SYS_clock_settime, "the host clock"),
    ("clock_adjtime", libc::SYS_clock_adjtime, "the host clock"),
    ("quotactl", libc::SYS_quotactl, "host filesystem quotas"),
    (
        "lookup_dcookie",
        libc::SYS_lookup_dcookie,
        "kernel profiling interface",
    ),
    ("vhangup", libc::SYS_vhangup, "hangs up the terminal"),
    ("iopl", libc::SYS_iopl, "raw I/O port access"),
    ("ioperm", libc::SYS_ioperm, "raw I/O port access"),
    ("uselib", libc::SYS_uselib, "obsolete loader interface"),
    (
        "fanotify_init",
        libc::SYS_fanotify_init,
        "filesystem-wide event monitoring",
    ),
];

/// clone3's syscall number as a BPF immediate.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "435 fits"
)]
const CLONE3: u32 = libc::SYS_clone3 as u32;

fn rule(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompRule, SeccompError> {
    let len = match op {
        SeccompCmpOp::MaskedEq(_) => SeccompCmpArgLen::Qword,
        _ => SeccompCmpArgLen::Dword,
    };
    let cond = SeccompCondition::new(arg, len, op, value).map_err(SeccompError::Build)?;
    SeccompRule::new(vec![cond]).map_err(SeccompError::Build)
}

fn namespace_flag_rules() -> Result<Vec<SeccompRule>, SeccompError> {
    NAMESPACE_FLAGS
        .iter()
        .map(|&f| rule(0, SeccompCmpOp::MaskedEq(f), f))
        .collect()
}

fn arch() -> Result<seccompiler::TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|_| SeccompError::Arch)
}

/// The deny-list filter.
pub fn deny_list() -> Result<BpfProgram, SeccompError> {
    compile(deny_rules()?)
}

/// The deny list's program for `rules` (from [`deny_rules`]).
fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch()?,
    )
    .map_err(SeccompError::Build)?;
    filter.try_into().map_err(SeccompError::Build)
}

/// Every system call the deny list has rules for, with its rules (none:
/// always refused).
fn deny_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (_, nr, _) in DENIED {
        rules.insert(*nr, vec![]);
    }
    // Namespaces: clone(2) and unshare(2) may not create any.
    rules.insert(libc::SYS_clone, namespace_flag_rules()?);
    rules.insert(libc::SYS_unshare, namespace_flag_rules()?);
    // Terminal injection: TIOCSTI pushes input into a terminal, TIOCLINUX into the console.
    rules.insert(
        libc::SYS_ioctl,
        vec![
            rule(1, SeccompCmpOp::Eq, libc::TIOCSTI)?,
            rule(1, SeccompCmpOp::Eq, libc::TIOCLINUX)?,
            // Every btrfs ioctl (type 0x94): a subvolume made inside a
            // stage of the btrfs layer store would escape its qgroup
            // limit, and the host alone snapshots and deletes stages.
            rule(1, SeccompCmpOp::MaskedEq(0xff00), 0x9400)?,
        ],
    );
    Ok(rules)
}

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
const BPF_LD: u16 = 0x00;
const BPF_W: u16 = 0x00;
const BPF_ABS: u16 = 0x20;
const BPF_JMP: u16 = 0x05;
const BPF_JEQ: u16 = 0x10;
const BPF_JGE: u16 = 0x30;
const BPF_JGT: u16 = 0x20;
const BPF_K: u16 = 0x00;
const BPF_RET: u16 = 0x06;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
#[cfg(target_arch = "x86_64")]
const NATIVE_AUDIT_ARCH: u32 = 62 | 0x8000_0000 | 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const NATIVE_AUDIT_ARCH: u32 = 183 | 0x8000_0000 | 0x4000_0000;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The guard filter: kills on a foreign architecture (e.g. 32-bit `int 0x80`
/// calls on x86_64), refuses the x32 ABI, and answers `clone3` with `ENOSYS`:
/// clone3 passes its flags in memory that a filter cannot read, and libc
/// falls back to clone(2), whose flags the deny list checks.
pub fn guard() -> BpfProgram {
    let mut prog = vec![
        // seccomp_data.arch is at offset 4.
        stmt(BPF_LD | BPF_W | BPF_ABS, 4),
        jump(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_AUDIT_ARCH, 1, 0),
        stmt(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        // seccomp_data.nr is at offset 0.
        stmt(BPF_LD | BPF_W | BPF_ABS, 0),
    ];
    if cfg!(target_arch = "x86_64") {
        prog.extend([
            jump(BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 0, 1),
            stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        ]);
    }
    prog.extend([
        // clone3 is syscall 435: it fits a BPF immediate.
        jump(BPF_JMP | BPF_JEQ | BPF_K, CLONE3, 0, 1),
        stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    ]);
    prog
}

/// A binary search over `numbers` (sorted, distinct), for the system call
/// number in the accumulator: a number not among them returns allow; one
/// among them jumps to the instruction just past this program.
///
/// Why: the deny list (seccompiler) compares the number with each of its
/// system calls in turn, and the kernel runs it once for every system call
/// number when a filter is installed (to cache which calls it always
/// allows): about half of the 0.4 ms an install took (`perf record -a`).
/// This search decides a call it has no rule for in a few comparisons.
///
/// Layout, each node for the middle number `k` of its range: `jeq k` (to
/// the end), `jgt k` (to the right half), then the left half's code and
/// the right half's; an empty range is `ret allow`. Every jump is forward;
/// one that would not fit a BPF jump's 8 bits is an error.
fn search(numbers: &[u32]) -> Result<BpfProgram, SeccompError> {
    fn size(n: usize) -> usize {
        // Two instructions a number, one a leaf (n + 1 leaves).
        3 * n + 1
    }
    fn emit(numbers: &[u32], prog: &mut BpfProgram, total: usize) -> Result<(), SeccompError> {
        if numbers.is_empty() {
            prog.push(stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
            return Ok(());
        }
        let mid = numbers.len() / 2;
        let (left, right) = (&numbers[..mid], &numbers[mid + 1..]);
        let here = prog.len();
        let offset = |n: usize| u8::try_from(n).map_err(|_| SeccompError::TooLong);
        // From the instruction after `jeq` to the end of the whole search.
        let to_end = offset(total - (here + 1))?;
        prog.push(jump(BPF_JMP | BPF_JEQ | BPF_K, numbers[mid], to_end, 0));
        // From the instruction after `jgt`, past the left half.
        let past_left = offset(size(left.len()))?;
        prog.push(jump(BPF_JMP | BPF_JGT | BPF_K, numbers[mid], past_left, 0));
        emit(left, prog, total)?;
        emit(right, prog, total)
    }
    let total = size(numbers.len());
    let mut prog = Vec::with_capacity(total);
    emit(numbers, &mut prog, total)?;
    debug_assert_eq!(prog.len(), total);
    Ok(prog)
}

/// The whole filter, ready to install: the guard, whose last instruction
/// (allow) gives way to a search over the numbers the deny list has rules
/// for ([`search`]), which allows any other call and sends those on to the
/// deny list. Every jump of each part is relative and stays within it
/// (the search's last ones land on the deny list's first instruction), so
/// the parts join without any being rewritten. The guard leaves the system
/// call number in the accumulator; the deny list loads what it reads.
pub fn filter() -> Result<BpfProgram, SeccompError> {
    let mut prog = guard();
    let allow = prog.pop();
    debug_assert!(allow.is_some_and(|i| i.code == BPF_RET | BPF_K && i.k == SECCOMP_RET_ALLOW));
    let rules = deny_rules()?;
    let numbers = rules
        .keys()
        .map(|&nr| u32::try_from(nr).map_err(|_| SeccompError::Arch))
        .collect::<Result<Vec<u32>, _>>()?;
    prog.extend(search(&numbers)?);
    prog.extend(compile(rules)?);
    Ok(prog)
}

/// Installs `filter` on the calling thread (and so on every process it
/// later starts). Sets `no_new_privs` first.
pub fn install(filter: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(filter).map_err(SeccompError::Install)
}

/// Installs `filter` on every thread of the process (a microVM guest's
/// agent has threads by the time its setup is done).
pub fn install_all_threads(filter: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter_all_threads(filter).map_err(SeccompError::Install)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_build_and_every_denied_entry_has_a_reason() {
        let f = filter().unwrap();
        assert!(f.len() > guard().len());
        for (name, _, why) in DENIED {
            assert!(!why.is_empty(), "{name} has no reason");
        }
    }

    /// Runs a seccomp program over a system call (number, architecture,
    /// arguments) the way the kernel does; gives what it returns and how
    /// many instructions ran. Panics on an instruction it does not know.
    fn run(prog: &[sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> (u32, usize) {
        const BPF_ALU: u16 = 0x04;
        const BPF_AND: u16 = 0x50;
        const BPF_JA: u16 = 0x00;
        let word = |off: u32| -> u32 {
            match off {
                0 => nr,
                4 => arch,
                8 | 12 => 0,
                o if (16..64).contains(&o) && o % 4 == 0 => {
                    let a = args[((o - 16) / 8) as usize];
                    if (o - 16) % 8 == 0 {
                        a as u32
                    } else {
                        (a >> 32) as u32
                    }
                }
                o => panic!("a load at offset {o}"),
            }
        };
        let (mut acc, mut pc, mut steps) = (0u32, 0usize, 0usize);
        loop {
            let i = &prog[pc];
            steps += 1;
            pc += 1;
            match i.code {
                c if c == BPF_LD | BPF_W | BPF_ABS => acc = word(i.k),
                c if c == BPF_RET | BPF_K => return (i.k, steps),
                c if c == BPF_ALU | BPF_AND | BPF_K => acc &= i.k,
                c if c == BPF_JMP | BPF_JA => pc += i.k as usize,
                c if c & 0x07 == BPF_JMP && c & 0x08 == BPF_K => {
                    let taken = match c & 0xf0 {
                        0x10 => acc == i.k,
                        0x20 => acc > i.k,
                        0x30 => acc >= i.k,
                        0x40 => acc & i.k != 0,
                        op => panic!("jump operation {op:#x}"),
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    /// The one program decides every call exactly as the guard followed by
    /// the deny list do, and allows a call the deny list has no rule for
    /// within a few instructions (the point of the search).
    #[test]
    fn the_joined_program_decides_as_the_guard_then_the_deny_list() {
        let joined = filter().unwrap();
        let (guard, deny) = (guard(), deny_list().unwrap());
        let ruled: Vec<u32> = deny_rules().unwrap().keys().map(|&n| n as u32).collect();
        let mut arg_sets = vec![[0u64; 6], [u64::MAX; 6]];
        for f in NAMESPACE_FLAGS {
            arg_sets.push([f, 0, 0, 0, 0, 0]);
            arg_sets.push([
                f | libc::SIGCHLD as u64 | libc::CLONE_VM as u64,
                0,
                0,
                0,
                0,
                0,
            ]);
        }
        for cmd in [
            libc::TIOCSTI,
            libc::TIOCLINUX,
            0x9401,
            0xc400_9401,
            libc::TCGETS,
        ] {
            arg_sets.push([1, cmd, 0, 0, 0, 0]);
            arg_sets.push([1, cmd | (1 << 32), 0, 0, 0, 0]);
        }
        let mut numbers: Vec<u32> = (0..600).collect();
        numbers.extend([
            X32_SYSCALL_BIT,
            X32_SYSCALL_BIT | libc::SYS_getpid as u32,
            X32_SYSCALL_BIT | libc::SYS_mount as u32,
            u32::MAX,
        ]);
        // AUDIT_ARCH_I386: a 32-bit call on x86_64.
        for arch in [NATIVE_AUDIT_ARCH, 0x4000_0003] {
            for &nr in &numbers {
                for args in arg_sets.iter().copied() {
                    let guarded = run(&guard, nr, arch, args).0;
                    let want = match guarded {
                        SECCOMP_RET_ALLOW => run(&deny, nr, arch, args).0,
                        other => other,
                    };
                    let (got, steps) = run(&joined, nr, arch, args);
                    assert_eq!(got, want, "call {nr:#x}, arch {arch:#x}, args {args:x?}");
                    if guarded == SECCOMP_RET_ALLOW && !ruled.contains(&nr) {
                        assert_eq!(got, SECCOMP_RET_ALLOW, "call {nr}");
                        assert!(steps <= 24, "call {nr} took {steps} instructions");
                    }
                }
            }
        }
        // The interpreter is not vacuous: what the kernel test below sees.
        let eperm = SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let native = |nr: i64, args| run(&joined, nr as u32, NATIVE_AUDIT_ARCH, args).0;
        assert_eq!(native(libc::SYS_mount, [0; 6]), eperm);
        assert_eq!(
            native(
                libc::SYS_unshare,
                [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0]
            ),
            eperm
        );
        assert_eq!(
            native(libc::SYS_unshare, [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0]),
            SECCOMP_RET_ALLOW
        );
        assert_eq!(native(libc::SYS_getpid, [0; 6]), SECCOMP_RET_ALLOW);
        assert_eq!(
            native(libc::SYS_clone3, [0; 6]),
            SECCOMP_RET_ERRNO | libc::ENOSYS as u32
        );
    }

    /// Whether `getpid` through the x32 ABI fails with `ENOSYS`.
    fn x32_getpid_refused() -> bool {
        // SAFETY: a raw getpid (no arguments, no memory) with the x32 bit set.
        let r = unsafe { libc::syscall(libc::SYS_getpid | X32_SYSCALL_BIT as libc::c_long) };
        r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS)
    }

    /// Installs the filter in a forked child and checks the kernel's answers.
    #[test]
    fn denies_in_a_child_process() {
        let filter = filter().unwrap();
        // SAFETY: the child only makes raw syscalls and exits.
        match unsafe { libc::fork() } {
            0 => {
                let ok = install(&filter).is_ok()
                    // SAFETY: raw syscalls with harmless arguments.
                    && unsafe { libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER) } == -1
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
                    // SAFETY: as above; clone3 must fail with ENOSYS before reading its args.
                    && unsafe { libc::syscall(libc::SYS_clone3, 0, 0) } == -1
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS)
                    // SAFETY: as above.
                    && unsafe { libc::syscall(libc::SYS_bpf, 0, 0, 0) } == -1
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
                    // SAFETY: as above; the deny list's argument rules still apply
                    // after the guard (TIOCSTI on a descriptor that is not open).
                    && unsafe { libc::syscall(libc::SYS_ioctl, -1, libc::TIOCSTI, 0) } == -1
                    && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
                    // A call through the x32 ABI is refused by the guard.
                    && (!cfg!(target_arch = "x86_64") || x32_getpid_refused())
                    // SAFETY: getpid is always safe; it must still be allowed.
                    && unsafe { libc::syscall(libc::SYS_getpid) } > 0;
                // SAFETY: _exit never returns and runs no destructors in the child.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) }
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for our own child, writing into a valid local.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
            }
        }
    }
}
