"""What setup.cfg declares agrees with the code: the transformers pin."""

import configparser

from tests.helpers.paths import ROOT


def test_declared_transformers_pin_is_the_code_pin():
    from hybridsp.integrations.transformers import MIN_TRANSFORMERS_VERSION

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    pins = [line.strip() for line in parser["options"]["install_requires"].splitlines() if "transformers" in line]
    assert pins == [f"transformers>={MIN_TRANSFORMERS_VERSION.removesuffix('.0')}"], pins
