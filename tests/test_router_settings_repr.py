"""The router's settings print no secret: an error message or a log line may show them."""

from kvstore.routing.http import FrontSettings


def test_the_routers_settings_repr_holds_no_key_or_secret() -> None:
    settings = FrontSettings(
        keys={"sk-caller-key-1234": "alpha"},
        ops_tenants=frozenset({"alpha"}),
        backend_key="sk-engine-key-5678",
        salt_secret=b"salt-secret-abcdefgh",
    )
    shown = repr(settings)
    for secret in ("sk-caller-key-1234", "sk-engine-key-5678", "salt-secret-abcdefgh"):
        assert secret not in shown
    assert "header_timeout_s" in shown
