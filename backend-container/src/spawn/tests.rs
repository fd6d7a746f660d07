//! Unit tests of the uid/gid maps.

use super::*;

#[test]
fn maps_with_and_without_an_owner_override() {
    let mut m = IdMap {
        host_root: 100_000,
        count: 65536,
        host_root_gid: 200_000,
        rootless: false,
        user_override: None,
    };
    assert_eq!(m.map_text(m.host_root, None), "0 100000 65536\n");
    assert_eq!(m.host_uid(SANDBOX_USER), 101_000);
    m.user_override = Some((4242, 4343));
    assert_eq!(
        m.map_text(m.host_root, Some(4242)),
        "0 100000 1000\n1000 4242 1\n1001 101001 64535\n"
    );
    assert_eq!(
        (m.host_uid(SANDBOX_USER), m.host_gid(SANDBOX_USER)),
        (4242, 4343)
    );
    assert_eq!(m.host_uid(0), 100_000);
}
