//! Child processes and files of the tests: nothing is left behind, neither after a test that
//! passes nor after one that fails.

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::OnceLock;

/// A child process that is killed (SIGKILL) and reaped when the guard drops — at the end of the
/// test, or while a failed test unwinds — unless it has exited already. Use it as the
/// [`Child`] it derefs to.
#[derive(Debug)]
pub struct ChildGuard(Child);

impl ChildGuard {
    /// Guards `child`.
    pub fn new(child: Child) -> Self {
        Self(child)
    }
}

impl Deref for ChildGuard {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

const SCRATCH_PREFIX: &str = "inbox-tests-";

static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

/// A directory of this test process's own in the system temp directory (`inbox-tests-<pid>`), for
/// files that outlive a single test (a copy of the ledger demo, logs, SQLite files): created on
/// first use and removed when the process exits, whether its tests passed or failed. Directories
/// left by test processes that no longer exist (killed before they could remove theirs) are
/// removed on the way.
pub fn scratch_dir() -> &'static Path {
    SCRATCH.get_or_init(|| {
        let temp = std::env::temp_dir();
        remove_orphaned_scratch_dirs(&temp);
        let dir = temp.join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
        // A directory of this name is an orphan of an earlier process with the same id.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the tests' scratch directory");
        // SAFETY: `remove_scratch_dir` is an `extern "C" fn()` that does not unwind (it ignores
        // every error) and only touches `SCRATCH`, which is set before it can run.
        unsafe { atexit(remove_scratch_dir) };
        dir
    })
}

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
}

/// Run by the C library when the process exits (the test harness exits with `exit`, also when a
/// test failed).
extern "C" fn remove_scratch_dir() {
    if let Some(dir) = SCRATCH.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Removes the `inbox-tests-<pid>` directories in `temp` whose process is gone.
fn remove_orphaned_scratch_dirs(temp: &Path) {
    if !Path::new("/proc/self").exists() {
        return; // No way to tell a live process from a dead one.
    }
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(SCRATCH_PREFIX))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
