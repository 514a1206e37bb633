"""Prefix-cache salts are the server's: a tenant's own unless an operator shares a group; `user` only narrows."""
import pytest

from kvserve.chat.salt import prefix_salt, prefix_scope, share_groups_parse

KEY = b"k" * 32


def test_each_tenant_has_its_own_scope_by_default():
    assert prefix_scope(1, "acme", {}) != prefix_scope(2, "globex", {})
    assert prefix_salt(KEY, prefix_scope(1, "acme", {})) != prefix_salt(KEY, prefix_scope(2, "globex", {}))


def test_user_narrows_and_no_user_value_reaches_another_tenant():
    a, b = prefix_scope(1, "acme", {}), prefix_scope(2, "globex", {})
    base_a = prefix_salt(KEY, a)
    assert prefix_salt(KEY, a, "alice") != base_a  # narrowed
    assert prefix_salt(KEY, a, "alice") == prefix_salt(KEY, a, "alice")
    assert prefix_salt(KEY, a, "") == base_a  # an empty user narrows nothing
    others = {prefix_salt(KEY, a), *(prefix_salt(KEY, a, u) for u in ("alice", "bob"))}
    # whatever B writes into `user` (A's scope, a salt, JSON), it never lands on one of A's salts
    for user in ("tenant:1", base_a, '"tenant:1"', '["tenant:1", null]', "acme", "1", "\u0000"):
        assert prefix_salt(KEY, b, user) not in others


def test_salt_depends_on_the_deployment_key():
    scope = prefix_scope(1, "acme", {})
    assert prefix_salt(KEY, scope) != prefix_salt(b"other key", scope)


def test_share_groups_are_operator_config_only():
    groups = share_groups_parse("public=acme, globex; solo=initech")
    assert groups == {"acme": "public", "globex": "public", "initech": "solo"}
    assert prefix_scope(1, "acme", groups) == prefix_scope(2, "globex", groups) == "group:public"
    assert prefix_scope(3, "initech", groups) != prefix_scope(1, "acme", groups)
    assert prefix_scope(4, "umbrella", groups) == "tenant:4"
    assert share_groups_parse("") == {}


@pytest.mark.parametrize("text", ["acme,globex", "=acme", "public=", "a=x;b=x"])
def test_share_groups_refuse_bad_config(text):
    with pytest.raises(ValueError, match="KVSERVE_PREFIX_SHARE_GROUPS"):
        share_groups_parse(text)
