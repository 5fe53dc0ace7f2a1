//! The host programs runcell runs (`mount`, `umount`, `mkfs.btrfs`,
//! `mkfs.ext4`, `cp`, `runsc`, QEMU, ...), found on `PATH` and then in the
//! system's standard directories, whatever `PATH` the daemon was started
//! with. Started with an empty environment (`env -i`, some init systems),
//! a daemon looked up `mkfs.ext4` and `mkfs.btrfs` on the C library's
//! default path (`/bin:/usr/bin`), so volumes could not be made and the
//! btrfs layer store was reported "not installed".

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where a Debian (or any FHS) system keeps its programs, searched after
/// `PATH`.
pub const SYSTEM_DIRS: [&str; 6] = [
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// The program `name` (a bare name) on `PATH` or in [`SYSTEM_DIRS`]; a
/// name with a slash is itself. `None` if there is no such executable file.
pub fn find(name: impl AsRef<Path>) -> Option<PathBuf> {
    let name = name.as_ref();
    if name.components().count() > 1 {
        return Some(name.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .filter(|d| d.is_absolute())
        .chain(SYSTEM_DIRS.iter().map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

/// `PATH` for a host program that runs others by name (debootstrap): the
/// daemon's, then each of [`SYSTEM_DIRS`] it lacks.
pub fn search_path() -> std::ffi::OsString {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .filter(|d| d.is_absolute())
        .collect();
    for d in SYSTEM_DIRS {
        if !dirs.iter().any(|have| have == Path::new(d)) {
            dirs.push(PathBuf::from(d));
        }
    }
    std::env::join_paths(dirs).unwrap_or_else(|_| SYSTEM_DIRS.join(":").into())
}

/// A [`Command`] for the host program `name`, resolved by [`find`]; the
/// bare name when it is nowhere, so that running it fails with "No such
/// file or directory" naming it.
pub fn command(name: &str) -> Command {
    match find(name) {
        Some(p) => Command::new(p),
        None => Command::new(OsStr::new(name)),
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_in_the_system_directories_without_a_path() {
        // This test's own PATH may be anything; the lookup must not need it
        // for a program in a standard directory.
        let sh = find("sh").expect("sh is installed");
        assert!(sh.is_absolute() && is_executable(&sh), "{}", sh.display());
        assert_eq!(find("/bin/true"), Some(PathBuf::from("/bin/true")));
        assert_eq!(find("runcell-no-such-program"), None);
        let missing = command("runcell-no-such-program").status().unwrap_err();
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        assert!(command("true").status().unwrap().success());
        let path = search_path();
        let dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
        for d in SYSTEM_DIRS {
            assert!(
                dirs.contains(&PathBuf::from(d)),
                "{d} missing from {path:?}"
            );
        }
    }
}
