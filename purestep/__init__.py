"""purestep: LLM training in pure PyTorch, built the way JAX people build (README.md).

``import purestep`` gives ``purestep.core``, ``purestep.models``, ``purestep.optim`` and ``purestep.recipes``; the
command line is ``purestep recipe=NAME key=value ...`` (``purestep/__main__.py``; ``bin/run`` in a checkout).

The repository keeps those packages as its top-level folders. An installed copy has them inside this package
(setup.cfg's ``package_dir``). In a checkout they are this folder's siblings, so the checkout's root joins this
package's search path (PEP 302's ``__path__``): ``import purestep.core`` then finds ``./core`` with or without an
install, and a worktree's own files win over another checkout's editable install.
"""
import os as _os

if _os.path.isfile(_os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "setup.cfg")):
    __path__.append(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
