"""Only what pyproject.toml cannot say: the switch's start-up hook file goes into
site-packages itself (Python runs ``.pth`` files only there), for ``pip install``
and ``pip install -e`` (``make install``) alike; docs/integrations.md, "How the
switch is installed".

``data_files`` install relative to the environment's prefix; the target is
site-packages' path relative to it (``lib/python3.X/site-packages`` in a venv),
read from the interpreter that builds, which is the one that installs.
"""

import os
import sysconfig

from setuptools import setup

_PURELIB = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))
cmdclass = {}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable wheels
    pass
else:
    class _EditableWheel(editable_wheel):
        """setuptools' editable wheel means to install data files as they are (not
        editable), but asks the distribution for ``has_data``, a method it does
        not have (it is ``has_data_files``), so it skips them: run it here."""

        def _run_install(self, category):
            if category == "data" and self.distribution.has_data_files():
                self.run_command("install_data")
                return
            super()._run_install(category)

    cmdclass["editable_wheel"] = _EditableWheel

setup(data_files=[(_PURELIB, ["src/lorasync/integrations/lorasync-switch.pth"])],
      cmdclass=cmdclass)
