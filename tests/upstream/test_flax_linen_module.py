"""Flax's Linen module tests that involve remat, ported to ``remat.checkpoint``.

Source: google/flax, ``tests/linen/linen_module_test.py`` (main at 18f8f311), the one test
there that uses ``nn.remat``: ``ModuleTest.test_module_path_in_nested_module``. The
computation and the assertions are upstream's, expected debug paths included; only
``nn.remat`` is replaced by ``remat.checkpoint``.
"""
from __future__ import annotations

from flax import linen as nn
from jax import random

import remat


def test_module_path_in_nested_module():
    module_paths = []
    debug_paths = []

    class A(nn.Module):
        def setup(self):
            self.b1 = B()
            self.b2 = B()
            self.c1 = C()

            module_paths.append(self.path)
            debug_paths.append(self.scope.debug_path)

        def __call__(self, x):
            return self.b1(x) + self.b2(x) + self.c1(x)

    class B(nn.Module):
        def setup(self):
            self.c1 = remat.checkpoint(remat.checkpoint(C))()
            self.c2 = C()

            module_paths.append(self.path)
            debug_paths.append(self.scope.debug_path)

        def __call__(self, x):
            return self.c1(x) + self.c2(x)

    class C(nn.Module):
        def setup(self):
            super().setup()
            if self.scope.__class__.__name__ != 'TestScope':
                module_paths.append(self.path)
                debug_paths.append(self.scope.debug_path)

        @nn.compact
        def __call__(self, x):
            return x

    a = A()
    k = random.key(0)
    x = random.uniform(random.key(42), (2,))
    _ = a.init(k, x)
    expected_module_paths = [
        (),
        ('b1',),
        ('b1', 'c1'),
        ('b1', 'c2'),
        ('b2',),
        ('b2', 'c1'),
        ('b2', 'c2'),
        ('c1',),
    ]
    expected_debug_paths = [
        (),
        ('b1',),
        ('b1', 'remat(remat(c1))'),
        ('b1', 'c2'),
        ('b2',),
        ('b2', 'remat(remat(c1))'),
        ('b2', 'c2'),
        ('c1',),
    ]

    assert module_paths == expected_module_paths
    assert debug_paths == expected_debug_paths
