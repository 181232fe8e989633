import pytest
from textkit import camel_case, slugify, snake_case, title_words


@pytest.mark.parametrize(
    ("text", "expected"),
    [("HTTP requestHandler v2", "http_request_handler_v2"), ("  hello   world ", "hello_world"), ("", "")],
)
def test_snake_case(text, expected):
    assert snake_case(text) == expected


def test_camel_case():
    assert camel_case("load config file") == "loadConfigFile"
    assert camel_case("load config file", upper_first=True) == "LoadConfigFile"
    assert camel_case("--") == ""


def test_title_words():
    assert title_words("the lord   of the rings") == "The Lord of the Rings"
    assert title_words("war and peace") == "War and Peace"
    assert title_words("of") == "Of"


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("Crème brûlée recipe", sep="_") == "crme_brle_recipe"
    assert slugify("one two three four", max_length=9) == "one-two"
