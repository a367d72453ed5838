"""What the pytest files that boot VMs share: the binary they run and the
skip mark that says what is missing."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TSUBAME = os.path.join(ROOT, "target", "release", "tsubame")


def needs_kvm(what):
    """Skips a test that boots VMs where /dev/kvm or the release binary is
    missing, saying which (`what` names the tests: "the QMP tests boot
    VMs")."""
    have_kvm = os.access("/dev/kvm", os.R_OK | os.W_OK)
    have_binary = os.access(TSUBAME, os.X_OK)
    return pytest.mark.skipif(
        not (have_kvm and have_binary),
        reason=f"{what}: they need /dev/kvm (read-write) and target/release/tsubame "
               f"(cargo build --release); here: /dev/kvm {'ok' if have_kvm else 'missing'}, "
               f"binary {'ok' if have_binary else 'missing'}")
