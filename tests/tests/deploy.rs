//! The deployment files: every systemd unit runs as an unprivileged user of its own, never as
//! root (issue 23, finding 9: the hub reads what a trainer names with its own privileges).

use std::path::Path;

fn unit(name: &str) -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/systemd")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("read the unit");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

fn get<'a>(u: &'a [(String, String)], key: &str) -> Option<&'a str> {
    u.iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

#[test]
fn every_unit_runs_as_an_unprivileged_user_of_its_own() {
    for name in [
        "starling-hub.service",
        "starling-relay.service",
        "starling-actor.service",
    ] {
        let u = unit(name);
        let user = get(&u, "User");
        let dynamic = get(&u, "DynamicUser") == Some("yes");
        assert!(
            dynamic || user.is_some_and(|u| u != "root" && u != "0"),
            "{name} runs as root (no User= and no DynamicUser=yes)"
        );
        assert_eq!(get(&u, "NoNewPrivileges"), Some("yes"), "{name}");
        assert_eq!(get(&u, "ProtectSystem"), Some("strict"), "{name}");
    }
    let hub = unit("starling-hub.service");
    assert_eq!(get(&hub, "User"), Some("starling"));
    assert_eq!(get(&hub, "CapabilityBoundingSet"), Some(""));
    assert_ne!(
        get(&hub, "ProtectHome"),
        None,
        "the hub may not write home directories"
    );
}
