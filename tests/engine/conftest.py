import pytest

from tiny_models import KINDS, build_pair


@pytest.fixture(params=KINDS)
def model_pair(request):
    return build_pair(request.param)
