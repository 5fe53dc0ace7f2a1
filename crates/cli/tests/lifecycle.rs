//! The clients of issue 14 (sandboxes that outlive their processes) against a
//! live daemon: the Rust client's pause/resume, hibernate/wake, snapshots,
//! forks, fork trees, promote and volumes, and the CLI commands over them.
//! Needs root.

mod common;

use std::collections::BTreeMap;

use common::*;
use runcell_client::{
    Client, CreateOptions, ExecOptions, ForkOptions, OnIdle, PromoteOptions, VolumeMount,
};
use serde_json::Value;

async fn sh(c: &Client, id: &str, cmd: &str) -> (i32, String) {
    let r = c.exec(id, cmd, &ExecOptions::default()).await.unwrap();
    (r.exit_code, r.stdout)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_client_pauses_hibernates_snapshots_and_forks() {
    let data = data_dir("client-14");
    let d = Daemon::start(&data, free_port(), &[]);
    let c = Client::new(&d.url, &d.key);

    // Pause and resume: calls are refused while paused, with the contract's words.
    let sb = c
        .create(&CreateOptions {
            on_idle: Some(OnIdle::Hibernate),
            ttl_seconds: Some(300),
            ..CreateOptions::default()
        })
        .await
        .unwrap();
    assert_eq!(
        sb.fields.get("on_idle").and_then(Value::as_str),
        Some("hibernate"),
        "{:?}",
        sb.fields
    );
    assert_eq!(sb.status(), "running");
    c.write_file(&sb.id, "/home/user/a.txt", b"kept\n".to_vec())
        .await
        .unwrap();
    c.pause(&sb.id).await.unwrap();
    assert_eq!(c.get_sandbox(&sb.id).await.unwrap().status(), "paused");
    let e = c
        .exec(&sb.id, "true", &ExecOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("paused; resume it first"), "{e}");
    assert_eq!(c.pause(&sb.id).await.unwrap_err().status(), Some(409));
    c.resume(&sb.id).await.unwrap();
    assert_eq!(c.resume(&sb.id).await.unwrap_err().status(), Some(409));
    assert_eq!(
        sh(&c, &sb.id, "cat /home/user/a.txt").await,
        (0, "kept\n".into())
    );

    // Hibernate, then an exec wakes it with its files and without its contexts.
    let ctx = c.create_context(&sb.id, "python").await.unwrap();
    c.run_cell(&sb.id, &ctx.id, "x = 1", None).await.unwrap();
    c.hibernate(&sb.id).await.unwrap();
    c.hibernate(&sb.id).await.unwrap();
    assert_eq!(c.get_sandbox(&sb.id).await.unwrap().status(), "hibernated");
    assert_eq!(
        sh(&c, &sb.id, "cat /home/user/a.txt").await,
        (0, "kept\n".into())
    );
    let woke = c.get_sandbox(&sb.id).await.unwrap();
    assert_eq!((woke.status(), woke.state_lost()), ("running", true));
    assert!(c.list_contexts(&sb.id).await.unwrap().is_empty());
    c.hibernate(&sb.id).await.unwrap();
    c.wake(&sb.id).await.unwrap();
    c.wake(&sb.id).await.unwrap();
    assert_eq!(c.get_sandbox(&sb.id).await.unwrap().status(), "running");

    // Snapshots: files only, listed per sandbox newest first, a template for new sandboxes.
    let snap = c.create_snapshot(&sb.id).await.unwrap();
    assert_eq!(
        (snap.sandbox_id.as_str(), snap.memory),
        (sb.id.as_str(), false)
    );
    assert!(snap.size_bytes > 0, "{snap:?}");
    c.write_file(&sb.id, "/home/user/a.txt", b"changed\n".to_vec())
        .await
        .unwrap();
    let snap2 = c.create_snapshot(&sb.id).await.unwrap();
    let listed: Vec<String> = c
        .list_snapshots(Some(&sb.id))
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(listed, [snap2.id.clone(), snap.id.clone()]);
    let copy = c
        .create(&CreateOptions {
            from_snapshot: Some(snap.id.clone()),
            ..CreateOptions::default()
        })
        .await
        .unwrap();
    assert_eq!(copy.from_snapshot(), Some(snap.id.as_str()));
    assert_eq!(
        c.read_file(&copy.id, "/home/user/a.txt").await.unwrap(),
        b"kept\n"
    );
    c.delete_snapshot(&snap2.id).await.unwrap();
    assert_eq!(
        c.get_snapshot(&snap2.id).await.unwrap_err().status(),
        Some(404)
    );
    assert_eq!(c.get_snapshot(&snap.id).await.unwrap().id, snap.id);

    // A fork copies files; the parent is left alone.
    let meta: BTreeMap<String, String> = [("branch".to_string(), "b".to_string())].into();
    let fork = c
        .fork(
            &sb.id,
            &ForkOptions {
                metadata: Some(meta),
                ttl_seconds: Some(120),
            },
        )
        .await
        .unwrap();
    assert_eq!(fork.forked_from(), Some(sb.id.as_str()));
    assert_eq!(fork.metadata("branch"), Some("b"));
    c.write_file(&fork.id, "/home/user/a.txt", b"fork\n".to_vec())
        .await
        .unwrap();
    assert_eq!(sh(&c, &sb.id, "cat /home/user/a.txt").await.1, "changed\n");

    // A fork tree and its winner.
    let tree = c.fork_tree(&sb.id, 3, None).await.unwrap();
    assert_eq!(tree.children.len(), 3);
    for child in &tree.children {
        assert_eq!(child.metadata("fork_tree_id"), Some(tree.tree_id.as_str()));
        assert_eq!(child.metadata("fork_parent"), Some(sb.id.as_str()));
    }
    assert_eq!(
        c.fork_tree(&sb.id, 17, None).await.unwrap_err().status(),
        Some(400)
    );
    let winner = &tree.children[1].id;
    let p = c
        .promote(
            winner,
            &PromoteOptions {
                cleanup_siblings: true,
                tree_id: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (&p.winner, p.tree_id.as_deref()),
        (winner, Some(tree.tree_id.as_str()))
    );
    let mut deleted = p.deleted.clone();
    deleted.sort();
    let mut losers = vec![tree.children[0].id.clone(), tree.children[2].id.clone()];
    losers.sort();
    assert_eq!(deleted, losers);
    assert!(p.failures.is_empty(), "{:?}", p.failures);
    assert_eq!(
        c.get_sandbox(winner)
            .await
            .unwrap()
            .metadata("fork_tree_id"),
        None
    );
    assert_eq!(
        c.get_sandbox(&losers[0]).await.unwrap_err().status(),
        Some(404)
    );

    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_rust_client_manages_volumes_that_outlive_their_sandboxes() {
    let data = data_dir("client-14-volumes");
    let d = Daemon::start(&data, free_port(), &[]);
    let c = Client::new(&d.url, &d.key);
    // Volumes: outlive their sandbox; one writer; not deleted while mounted.
    let v = c.create_volume("data-14", 16).await.unwrap();
    assert_eq!((v.name.as_str(), v.size_mb), ("data-14", 16));
    assert_eq!(
        c.create_volume("Bad Name", 16).await.unwrap_err().status(),
        Some(400)
    );
    let e = c.create_volume("too-big", 65536).await.unwrap_err();
    assert!(
        e.status() == Some(429) && e.to_string().contains("quota"),
        "{e}"
    );
    let with = |spec: &str| CreateOptions {
        volumes: vec![spec.parse::<VolumeMount>().unwrap()],
        ..CreateOptions::default()
    };
    let writer = c.create(&with("data-14")).await.unwrap();
    assert_eq!(
        writer.fields["volumes"],
        serde_json::json!([{"name": "data-14", "path": "/mnt/data-14", "read_only": false}])
    );
    c.write_file(&writer.id, "/mnt/data-14/f.txt", b"vol\n".to_vec())
        .await
        .unwrap();
    assert_eq!(
        c.create(&with("data-14")).await.unwrap_err().status(),
        Some(409)
    );
    assert_eq!(
        c.delete_volume("data-14").await.unwrap_err().status(),
        Some(409)
    );
    let reader = c.create(&with("data-14:ro:/data")).await.unwrap();
    assert_eq!(
        sh(&c, &reader.id, "cat /data/f.txt").await,
        (0, "vol\n".into())
    );
    assert_ne!(sh(&c, &reader.id, "echo x > /data/g.txt").await.0, 0);
    assert_eq!(c.get_volume("data-14").await.unwrap().attached_to.len(), 2);
    c.delete_sandbox(&writer.id).await.unwrap();
    c.delete_sandbox(&reader.id).await.unwrap();
    let later = c.create(&with("data-14")).await.unwrap();
    assert_eq!(
        c.read_file(&later.id, "/mnt/data-14/f.txt").await.unwrap(),
        b"vol\n"
    );
    c.delete_sandbox(&later.id).await.unwrap();
    assert!(c
        .list_volumes()
        .await
        .unwrap()
        .iter()
        .any(|v| v.name == "data-14" && v.attached_to.is_empty()));
    c.delete_volume("data-14").await.unwrap();
    assert_eq!(
        c.get_volume("data-14").await.unwrap_err().status(),
        Some(404)
    );

    d.delete_all().await;
}

/// `runcell ARGS` against `d`, which must succeed; its stdout.
fn ok(d: &Daemon, args: &[&str]) -> String {
    let (code, out, err) = runcell_cli(d, args);
    assert_eq!(code, 0, "runcell {}: {err}", args.join(" "));
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_pauses_hibernates_snapshots_and_forks() {
    let data = data_dir("cli-14");
    let d = Daemon::start(&data, free_port(), &[]);
    let cli = |args: &[&str]| runcell_cli(&d, args);
    let ok = |args: &[&str]| ok(&d, args);

    let id = ok(&["sandbox", "create", "--on-idle", "hibernate"])
        .trim()
        .to_string();
    assert!(ok(&["sandbox", "get", &id]).contains("On idle    hibernate"));
    ok(&["exec", &id, "--", "echo local > /home/user/l.txt"]);

    assert_eq!(
        ok(&["sandbox", "pause", &id]),
        format!("Paused sandbox {id}.\n")
    );
    assert!(ok(&["sandbox", "ls"]).contains(" paused "));
    let (code, _, err) = cli(&["exec", &id, "--", "true"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("paused; resume it first") && err.contains("409"),
        "{err}"
    );
    let json: Value = serde_json::from_str(&ok(&["sandbox", "resume", &id, "--json"])).unwrap();
    assert_eq!(json, serde_json::json!({"id": id, "status": "running"}));
    let (code, _, err) = cli(&["sandbox", "resume", &id]);
    assert_eq!(code, 1);
    assert!(err.contains("409"), "{err}");
    assert_eq!(
        ok(&["sandbox", "hibernate", &id]),
        format!("Hibernated sandbox {id}.\n")
    );
    assert!(ok(&["sandbox", "ls"]).contains(" hibernated "));
    // exec wakes it.
    assert_eq!(ok(&["exec", &id, "--", "cat /home/user/l.txt"]), "local\n");
    assert!(ok(&["sandbox", "get", &id]).contains("State      lost"));
    ok(&["sandbox", "hibernate", &id]);
    assert_eq!(
        ok(&["sandbox", "wake", &id]),
        format!("Woke sandbox {id}.\n")
    );
    assert!(ok(&["sandbox", "get", &id]).contains("Status     running"));

    let snap = ok(&["sandbox", "snapshot", &id]).trim().to_string();
    let snaps = ok(&["snapshot", "ls", "--sandbox", &id]);
    assert!(snaps.starts_with("ID") && snaps.contains(&snap), "{snaps}");
    let json: Value = serde_json::from_str(&ok(&["snapshot", "get", &snap, "--json"])).unwrap();
    assert_eq!(
        (json["sandbox_id"].as_str(), json["memory"].as_bool()),
        (Some(id.as_str()), Some(false))
    );
    let copy = ok(&["sandbox", "create", "--from-snapshot", &snap])
        .trim()
        .to_string();
    assert_eq!(
        ok(&["exec", &copy, "--", "cat /home/user/l.txt"]),
        "local\n"
    );
    assert!(ok(&["sandbox", "get", &copy]).contains(&format!("Snapshot   {snap}")));

    let fork = ok(&["sandbox", "fork", &id, "--meta", "k=v"])
        .trim()
        .to_string();
    let view = ok(&["sandbox", "get", &fork]);
    assert!(view.contains(&format!("Fork of    {id}")), "{view}");
    assert!(view.contains("k=v"), "{view}");
    let (code, out, err) = cli(&["sandbox", "fork", &id, "--count", "2"]);
    assert_eq!(code, 0, "{err}");
    let children: Vec<&str> = out.lines().collect();
    assert_eq!(children.len(), 2, "{out}");
    assert!(
        err.starts_with(&format!("Forked {id} 2 times (tree ")),
        "{err}"
    );
    let promoted = ok(&["sandbox", "promote", children[0], "--cleanup-siblings"]);
    assert_eq!(
        promoted,
        format!(
            "Promoted {}; it is independent now.\nDeleted sibling {}.\n",
            children[0], children[1]
        )
    );
    let (code, _, err) = cli(&["sandbox", "get", children[1]]);
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");

    ok(&["snapshot", "rm", &snap]);
    assert_eq!(ok(&["snapshot", "ls", "--sandbox", &id]), "No snapshots.\n");
    let (code, _, err) = cli(&["snapshot", "rm", &snap]);
    assert_eq!(code, 1);
    assert!(err.contains("404"), "{err}");
    ok(&["sandbox", "kill", &id, &copy, &fork, children[0]]);
    d.delete_all().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_manages_volumes_and_mounts_them() {
    let data = data_dir("cli-14-volumes");
    let d = Daemon::start(&data, free_port(), &[]);
    let cli = |args: &[&str]| runcell_cli(&d, args);
    let ok = |args: &[&str]| ok(&d, args);

    assert_eq!(ok(&["volume", "ls"]), "No volumes.\n");
    assert_eq!(
        ok(&["volume", "create", "cli-vol", "--size-mb", "8"]),
        "cli-vol\n"
    );
    let ls = ok(&["volume", "ls"]);
    assert!(
        ls.starts_with("NAME") && ls.contains("cli-vol") && ls.contains("8 MiB"),
        "{ls}"
    );
    let (code, _, err) = cli(&["volume", "create", "x", "--size-mb", "0"]);
    assert_eq!(code, 2, "{err}");

    let id = ok(&["sandbox", "create", "--volume", "cli-vol:/vol"])
        .trim()
        .to_string();
    let view = ok(&["sandbox", "get", &id]);
    assert!(view.contains("Volumes    cli-vol at /vol"), "{view}");
    ok(&["exec", &id, "--", "echo saved > /vol/v.txt"]);
    let ro = ok(&["sandbox", "create", "-v", "cli-vol:ro"])
        .trim()
        .to_string();
    assert_eq!(
        ok(&["exec", &ro, "--", "cat /mnt/cli-vol/v.txt"]),
        "saved\n"
    );
    let (code, _, _) = cli(&["exec", &ro, "--", "touch /mnt/cli-vol/w"]);
    assert_ne!(code, 0, "a read-only mount took a write");
    let (code, _, err) = cli(&["sandbox", "create", "--volume", "cli-vol"]);
    assert_eq!(code, 1);
    assert!(err.contains("409"), "a second writer: {err}");
    let (code, _, err) = cli(&["volume", "rm", "cli-vol"]);
    assert_eq!(code, 1);
    assert!(err.contains("409"), "{err}");
    ok(&["sandbox", "kill", &id, &ro]);
    let later = ok(&["sandbox", "create", "--volume", "cli-vol"])
        .trim()
        .to_string();
    assert_eq!(
        ok(&["exec", &later, "--", "cat /mnt/cli-vol/v.txt"]),
        "saved\n"
    );
    ok(&["sandbox", "kill", &later]);
    ok(&["volume", "rm", "cli-vol"]);
    assert_eq!(ok(&["volume", "ls"]), "No volumes.\n");
    d.delete_all().await;
}
