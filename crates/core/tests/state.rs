//! Sandboxes that outlive their processes, at the core level: pausing
//! (the cgroup freezer), saving what a sandbox wrote as a state layer and
//! starting other sandboxes from it (forks, snapshots, waking), and host
//! directories bound in (volumes). Real sandboxes; needs root.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use runcell_core::backend::BindMount;
use runcell_core::{Runtime, Sandbox, SandboxOptions};

fn root() -> runcell_core::RunOptions {
    runcell_core::RunOptions {
        user: Some(runcell_protocol::ExecUser {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        }),
        ..Default::default()
    }
}

fn layers_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(format!(
        "/run/runcell-test/layers-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn from_layers(rt: &Runtime, template: &str, layers: Vec<PathBuf>) -> Sandbox {
    rt.create(SandboxOptions {
        template: template.into(),
        limits: limits(),
        state_layers: layers,
        ..SandboxOptions::default()
    })
    .await
    .expect("a sandbox from saved files")
}

async fn stdout(sb: &Sandbox, script: &str) -> String {
    let r = sh(sb, script).await;
    assert_eq!(r.outcome.status(), 0, "{script}: {}", text(&r.stderr));
    text(&r.stdout)
}

#[tokio::test]
async fn saved_files_start_a_new_sandbox_and_the_two_then_differ() {
    let rt = runtime("state-save");
    let dir = layers_dir("save");
    let parent = sandbox(&rt, limits()).await;
    stdout(
        &parent,
        "echo kept > ~/note && mkdir -p ~/.local/lib/pkg && echo v1 > ~/.local/lib/pkg/mod.py \
         && echo gone > ~/deleted && echo tmp > /tmp/t",
    )
    .await;

    // A file of the first layer deleted later must stay deleted (a whiteout).
    let first = dir.join("one");
    let bytes = parent.save_layer(&first).unwrap();
    assert!(bytes > 0);
    assert!(
        !parent.is_paused(),
        "saving thaws a sandbox that was running"
    );
    stdout(&parent, "rm ~/deleted && echo two > ~/second").await;
    let second = dir.join("two");
    parent.save_layer(&second).unwrap();

    // The parent had no saved layers: its second layer alone is its state.
    let child = from_layers(&rt, "host", vec![second.clone()]).await;
    let seen = stdout(
        &child,
        "cat ~/note ~/.local/lib/pkg/mod.py /tmp/t ~/second; \
         test -e ~/deleted && echo deleted-file-is-back; true",
    )
    .await;
    assert_eq!(seen, "kept\nv1\ntmp\ntwo\n");
    // Copy-on-write both ways: neither sees what the other writes now.
    stdout(&child, "echo child > ~/note").await;
    stdout(&parent, "echo parent > ~/only-parent").await;
    assert_eq!(stdout(&parent, "cat ~/note").await, "kept\n");
    assert_eq!(
        stdout(&child, "test -e ~/only-parent && echo leak; cat ~/note").await,
        "child\n"
    );
    // A file of a lower layer deleted in a sandbox started from it stays
    // deleted in the next (a whiteout in the layer).
    stdout(&child, "rm ~/.local/lib/pkg/mod.py").await;
    let third = dir.join("three");
    child.save_layer(&third).unwrap();
    let grandchild = from_layers(&rt, "host", vec![third, second.clone()]).await;
    assert_eq!(
        stdout(&grandchild, "cat ~/note; ls ~/.local/lib/pkg").await,
        "child\n"
    );
    grandchild.destroy().await.unwrap();
    // And a layer is a directory of the sandbox's own files only: no host
    // path the template overlays was copied whole.
    assert!(
        !first.join("root/usr/bin").exists(),
        "the host's /usr was copied"
    );
    for sb in [parent, child] {
        sb.destroy().await.unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reads a file of a running sandbox from the host (without an exec, which
/// a paused sandbox would not answer).
fn peek(sb: &Sandbox, path: &str) -> String {
    std::fs::read_to_string(format!("/proc/{}/root{path}", sb.agent_pid())).unwrap_or_default()
}

#[tokio::test]
async fn a_paused_sandbox_stops_running_and_resumes_where_it_was() {
    let rt = runtime("state-pause");
    let sb = sandbox(&rt, limits()).await;
    let opts = runcell_core::RunOptions {
        background: true,
        ..Default::default()
    };
    sb.exec(
        runcell_protocol::Command::Shell(
            "(i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.01; done) > /dev/null 2>&1 &".into(),
        ),
        &opts,
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    sb.pause().unwrap();
    assert!(sb.is_paused());
    let a = peek(&sb, "/tmp/tick");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let b = peek(&sb, "/tmp/tick");
    assert!(!a.is_empty());
    assert_eq!(a, b, "a paused sandbox kept running");
    sb.resume().unwrap();
    assert!(!sb.is_paused());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = peek(&sb, "/tmp/tick");
    assert_ne!(b, c, "a resumed sandbox did not run again");
    assert_eq!(stdout(&sb, "echo alive").await, "alive\n");

    // A paused sandbox can still be destroyed, and nothing is left.
    sb.pause().unwrap();
    let id = sb.id().to_string();
    sb.destroy().await.unwrap();
    assert!(!rt.list().contains(&id));
    assert!(!Path::new(&format!(
        "/sys/fs/cgroup/freezer/runcell-test-state-pause/{id}"
    ))
    .exists());
}

#[tokio::test]
async fn a_bound_directory_is_shared_and_a_read_only_one_refuses_writes() {
    let rt = runtime("state-mount");
    let dir = layers_dir("mount");
    let vol = dir.join("vol");
    std::fs::create_dir_all(&vol).unwrap();
    // Owned by the sandbox user (uid 1000 inside is host base + 1000).
    let uid = runcell_jail::IdMap::default().host_base + 1000;
    std::os::unix::fs::chown(&vol, Some(uid), Some(uid)).unwrap();
    let mount = |read_only| BindMount {
        source: vol.clone(),
        target: PathBuf::from("/mnt/data"),
        read_only,
    };
    let writer = rt
        .create(SandboxOptions {
            limits: limits(),
            mounts: vec![mount(false)],
            ..SandboxOptions::default()
        })
        .await
        .unwrap();
    stdout(&writer, "echo shared > /mnt/data/f").await;
    assert_eq!(std::fs::read_to_string(vol.join("f")).unwrap(), "shared\n");
    writer.destroy().await.unwrap();
    assert!(vol.join("f").exists(), "the directory outlives the sandbox");

    let reader = rt
        .create(SandboxOptions {
            limits: limits(),
            mounts: vec![mount(true)],
            ..SandboxOptions::default()
        })
        .await
        .unwrap();
    assert_eq!(stdout(&reader, "cat /mnt/data/f").await, "shared\n");
    let r = sh(&reader, "echo x > /mnt/data/g").await;
    assert_ne!(r.outcome.status(), 0);
    assert!(text(&r.stderr).contains("Read-only"), "{}", text(&r.stderr));
    reader.destroy().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_saved_layer_cannot_steer_setup_out_of_the_root_through_a_symlink() {
    let rt = runtime("state-symlink");
    let dir = layers_dir("symlink");
    let sb = sandbox(&rt, limits()).await;
    // Root of the sandbox swaps /tmp for a symlink to a host path.
    let r = sb
        .exec(
            runcell_protocol::Command::Shell("rm -rf /tmp && ln -s /etc /tmp".into()),
            &root(),
        )
        .await
        .unwrap();
    assert_eq!(r.outcome.status(), 0, "{}", text(&r.stderr));
    let layer = dir.join("evil");
    sb.save_layer(&layer).unwrap();
    sb.destroy().await.unwrap();
    let err = rt
        .create(SandboxOptions {
            limits: limits(),
            state_layers: vec![layer],
            ..SandboxOptions::default()
        })
        .await
        .expect_err("a layer with /tmp a symlink must not start");
    assert!(err.to_string().contains("symlink"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
