//! Volumes in gVisor sandboxes: a volume written by a gVisor sandbox is
//! read and written by a jail sandbox of the same user after it, and the
//! other way round, with the same owners on the volume's disk
//! (`host_base + uid`, as a jail sandbox writes them); read-only holds
//! (`EROFS`), one writer at a time holds, the size holds (`ENOSPC`), and
//! deleting the sandboxes leaves no mount behind on the host. Real daemon,
//! real HTTP; needs root and runsc.

mod common;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn gvisor_and_jail_sandboxes_share_a_volume_with_the_same_owners() {
    let data = data_dir("gv-volumes");
    let d = Daemon::start(&data, free_port(), &[]);
    let data_str = data.display().to_string();
    let (s, body) = d
        .post("/v1/volumes", json!({"name": "shared", "size_mb": 8}))
        .await;
    assert_eq!(s, 201, "{body}");
    let on_host = volume_on_host(&data);
    let mounts_before = mounts_mentioning(&data_str);
    let gvisor = |extra: Value| {
        let mut body = json!({"isolation": "gvisor", "ttl_seconds": 300,
                              "volumes": [{"name": "shared"}]});
        if let Value::Object(m) = extra {
            body.as_object_mut().unwrap().extend(m);
        }
        body
    };

    // A gVisor writer: its files are its user's inside, and on the disk
    // they are owned as a jail sandbox's user's files are.
    let a = d.create(gvisor(json!({}))).await;
    // gVisor's kernel answers, not the host's.
    assert_eq!(ok(&d, &a, "uname -r").await, "4.4.0\n");
    let out = ok(
        &d,
        &a,
        "echo gvisor-1 > /mnt/shared/f && mkdir /mnt/shared/from-gvisor \
         && echo y > /mnt/shared/from-gvisor/y && id -u && stat -c '%u:%g' /mnt/shared/f",
    )
    .await;
    assert_eq!(out, "1000\n1000:1000\n");
    for p in ["f", "from-gvisor", "from-gvisor/y"] {
        assert_eq!(
            owner(&on_host.join(p)),
            (HOST_BASE + 1000, HOST_BASE + 1000),
            "{p} on the volume's disk"
        );
    }
    // The mount gVisor's gofer is handed is the host's idmapped bind.
    let idmapped: Vec<String> = mounts_mentioning(&a)
        .into_iter()
        .filter(|l| l.contains("/volumes/0 "))
        .collect();
    assert_eq!(idmapped.len(), 1, "{idmapped:?}");
    assert!(idmapped[0].contains("idmapped"), "{idmapped:?}");

    // One writer at a time, whatever the isolation of the second.
    for iso in ["jail", "gvisor"] {
        let (s, body) = d
            .post(
                "/v1/sandboxes",
                json!({"isolation": iso, "volumes": [{"name": "shared"}]}),
            )
            .await;
        assert_eq!(s, 409, "{iso}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains("one writer"),
            "{body}"
        );
    }

    // A read-only gVisor reader beside it: reads, sees the writer's later
    // writes, and cannot write (the host's mount refuses).
    let r = d
        .create(gvisor(
            json!({"volumes": [{"name": "shared", "read_only": true, "path": "/data"}]}),
        ))
        .await;
    assert_eq!(ok(&d, &r, "cat /data/f").await, "gvisor-1\n");
    ok(&d, &a, "echo gvisor-1b >> /mnt/shared/f").await;
    assert_eq!(ok(&d, &r, "cat /data/f").await, "gvisor-1\ngvisor-1b\n");
    assert_cannot_write(&d, &r, "/data", &on_host).await;
    let ro: Vec<String> = mounts_mentioning(&r)
        .into_iter()
        .filter(|l| l.contains("/volumes/0 "))
        .collect();
    assert!(
        ro.len() == 1 && ro[0].split(' ').nth(5).unwrap().starts_with("ro,"),
        "{ro:?}"
    );

    // The volume's size holds: a write past it fails plainly, and the
    // volume is usable once the file is gone.
    let (code, _, err) = sh(
        &d,
        &a,
        "dd if=/dev/zero of=/mnt/shared/big bs=1M count=16 status=none",
    )
    .await;
    assert_ne!(code, 0);
    assert!(err.contains("No space left on device"), "{err}");
    ok(&d, &a, "rm /mnt/shared/big").await;

    // Deleting both leaves no mount of theirs on the host.
    d.delete(&a).await;
    d.delete(&r).await;
    for id in [&a, &r] {
        wait_gone(&data.join("sandboxes-gvisor").join(id)).await;
        assert_eq!(mounts_mentioning(id), Vec::<String>::new(), "{id}");
    }
    assert_eq!(mounts_mentioning(&data_str), mounts_before);

    // A jail sandbox after it reads and writes what gVisor wrote, gVisor's
    // directory included, and its own files have the same owners.
    let j = d
        .create(json!({"isolation": "jail", "volumes": [{"name": "shared"}]}))
        .await;
    assert_eq!(
        ok(
            &d,
            &j,
            "cat /mnt/shared/f && echo jail-2 >> /mnt/shared/f \
             && echo j >> /mnt/shared/from-gvisor/y && mkdir /mnt/shared/from-jail \
             && echo z > /mnt/shared/from-jail/z && stat -c '%u:%g' /mnt/shared/from-jail/z"
        )
        .await,
        "gvisor-1\ngvisor-1b\n1000:1000\n"
    );
    d.delete(&j).await;
    assert_eq!(
        owner(&on_host.join("from-jail/z")),
        (HOST_BASE + 1000, HOST_BASE + 1000)
    );

    // A second gVisor sandbox reads the jail's append and writes again,
    // into the jail's directory too.
    let b = d.create(gvisor(json!({}))).await;
    assert_eq!(
        ok(
            &d,
            &b,
            "cat /mnt/shared/f /mnt/shared/from-gvisor/y && echo gvisor-3 >> /mnt/shared/f \
             && echo g >> /mnt/shared/from-jail/z && cat /mnt/shared/from-jail/z"
        )
        .await,
        "gvisor-1\ngvisor-1b\njail-2\ny\nj\nz\ng\n"
    );
    d.delete(&b).await;
    assert_eq!(
        std::fs::read_to_string(on_host.join("f")).unwrap(),
        "gvisor-1\ngvisor-1b\njail-2\ngvisor-3\n"
    );
    wait_gone(&data.join("sandboxes-gvisor").join(&b)).await;
    assert_eq!(mounts_mentioning(&b), Vec::<String>::new());

    assert_eq!(
        d.status(Method::DELETE, "/v1/volumes/shared", None).await,
        204
    );
    assert!(!on_host.exists(), "the volume's mount point was left");
}

/// A hibernated gVisor sandbox keeps its volume (nobody else may write it
/// while it sleeps) and wakes with it mounted again and its memory kept,
/// an open file on the volume included; a snapshot of it says it carries
/// no memory.
#[tokio::test(flavor = "multi_thread")]
async fn a_gvisor_sandbox_hibernates_and_wakes_with_its_volume() {
    let data = data_dir("gv-volumes-wake");
    let d = Daemon::start(&data, free_port(), &[]);
    let (s, body) = d
        .post("/v1/volumes", json!({"name": "kept", "size_mb": 8}))
        .await;
    assert_eq!(s, 201, "{body}");
    let id = d
        .create(json!({"isolation": "gvisor", "ttl_seconds": 300,
                       "volumes": [{"name": "kept", "path": "/work"}]}))
        .await;
    ok(&d, &id, "echo before > /work/f").await;
    let session = d.create_session(&id, json!({"language": "python"})).await;
    let sid = session["id"].as_str().unwrap().to_string();
    let run = |code: &str| {
        d.req(
            Method::POST,
            &format!("/v1/sandboxes/{id}/repl/sessions/{sid}/run"),
        )
        .json(&json!({ "code": code }))
    };
    let r = run("h = open('/work/f', 'a'); x = 42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // A snapshot carries its files only: its children get no volumes, and
    // its processes could not be restored without them.
    let (s, snap) = d
        .post(&format!("/v1/sandboxes/{id}/snapshots"), json!({}))
        .await;
    assert_eq!((s, &snap["memory"]), (201, &json!(false)), "{snap}");
    let snap_path = format!("/v1/snapshots/{}", snap["id"].as_str().unwrap());
    assert_eq!(d.status(Method::DELETE, &snap_path, None).await, 204);
    assert_eq!(act(&d, &id, "hibernate").await, 204);
    assert_eq!(d.sandbox(&id).await["status"], "hibernated");
    wait_gone(&data.join("sandboxes-gvisor").join(&id)).await;
    assert_eq!(mounts_mentioning(&id), Vec::<String>::new());
    let (s, body) = d
        .post(
            "/v1/sandboxes",
            json!({"isolation": "jail", "volumes": [{"name": "kept"}]}),
        )
        .await;
    assert_eq!(s, 409, "a second writer while it sleeps: {body}");
    // A cell wakes it: its variable and its open file are still there.
    let r = run("h.write('after\\n'); h.flush(); print(x)")
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_eq!((status, &v["stdout"]), (200, &json!("42\n")), "{v}");
    let view = d.sandbox(&id).await;
    assert_ne!(view["state_lost"], true, "{view}");
    assert_eq!(ok(&d, &id, "cat /work/f").await, "before\nafter\n");
    d.delete(&id).await;
    wait_gone(&data.join("sandboxes-gvisor").join(&id)).await;
    assert_eq!(mounts_mentioning(&id), Vec::<String>::new());
    assert_eq!(
        d.status(Method::DELETE, "/v1/volumes/kept", None).await,
        204
    );
}
