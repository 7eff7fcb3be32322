"""A reward plug-in module whose import fails (tests/test_rewards_plugins.py)."""

import package_that_does_not_exist_anywhere  # noqa: F401
