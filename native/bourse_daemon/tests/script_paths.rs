//! bucket.lua decides the common check in `admit_plain`, without `decide`'s tables, and
//! every other in `decide`. `tests/support/script_paths.lua` runs random sequences of
//! `checks` calls through the script as it is and through the script with `admit_plain`
//! never taken, each on its own Redis written in Lua, and compares the answers and every
//! key, field and expiry after each call; now and then another program writes an odd value
//! (`nan`, `inf`, `1e309`, ...) into a bucket's field, or a bucket expires.
//!
//! Runs `lua5.1`, the Lua of Redis's scripts; skips, saying so, when it is not installed
//! (`make deps` installs it).

use std::path::Path;
use std::process::Command;

const STEPS: &str = "4000";

#[test]
fn the_common_check_is_decided_as_every_check_is() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let harness = crate_dir.join("tests/support/script_paths.lua");
    let script = crate_dir.join("src/redis/bucket.lua");
    for seed in 1..=12 {
        let output = match Command::new("lua5.1")
            .arg(&harness)
            .arg(&script)
            .arg(seed.to_string())
            .arg(STEPS)
            .output()
        {
            Ok(output) => output,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                eprintln!("SKIPPED: no lua5.1 binary on PATH (make deps installs it)");
                return;
            }
            Err(error) => panic!("cannot run lua5.1: {error}"),
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "seed {seed}: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // The sequence must take the common path often, or it compares nothing.
        let taken: u32 = stdout
            .trim()
            .strip_prefix("admit_plain ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("seed {seed}: unexpected output {stdout}"));
        assert!(
            taken >= 100,
            "seed {seed}: admit_plain decided only {taken} checks"
        );
    }
}
