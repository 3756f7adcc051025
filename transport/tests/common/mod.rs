//! What the transport's integration tests share: a fresh cluster with the hub's credentials and
//! one actor's.

use std::path::Path;

use starling_transport::identity::{Credentials, Role, init_cluster, issue};

/// A cluster under `dir` (`dir/cluster`), and the credentials of its hub and of actor `a1`.
pub(crate) fn hub_and_actor(dir: &Path) -> (Credentials, Credentials) {
    let cluster = dir.join("cluster");
    init_cluster(&cluster, "test", [7; 32]).expect("init");
    let hub = Credentials::load_hub(&cluster).expect("hub creds");
    issue(&cluster, Role::Actor, "a1", &dir.join("a1")).expect("issue a1");
    let a1 = Credentials::load_peer(&dir.join("a1")).expect("a1 creds");
    (hub, a1)
}
