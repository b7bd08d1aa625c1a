#!/usr/bin/env python3
"""Reports every C++ function whose body is longer than a limit (default 90 lines).

    function_length.py [--max-lines N] [--verbose] PATH...

PATHs are files or directories (searched for .hpp, .h, .cpp, .cc, .cxx, .hxx, .ipp). A
function's length is the number of lines from the one holding its opening brace to the one
holding its closing brace, both included. Exit status 1 when any function exceeds the limit,
2 when a file cannot be parsed (unbalanced braces after stripping), else 0.

How it finds functions, without a C++ parser: comments, string and character literals and
preprocessor lines are blanked out (newlines kept, so line numbers stay right); then the braces
of each namespace or class scope are classified by the text since the previous `;`, `{`, `}`
or access specifier at that scope (the "head"):
  - a head naming namespace / class / struct / union / enum / extern (after any
    `template <...>` prefix) opens a scope that is searched in turn;
  - a head holding a balanced parameter list `(...)` opens a function body (lambdas assigned at
    namespace scope count as functions); a brace inside an unbalanced `(` is a default argument
    and a brace after an identifier in a constructor's initializer list is a member initializer,
    both skipped as part of the head;
  - any other head (`int table[] = {...}`, `T member{}`) opens an initializer, skipped.
Everything inside a function body (lambdas, local classes) counts toward that function.
"""
import argparse
import os
import re
import sys

EXTENSIONS = (".hpp", ".h", ".cpp", ".cc", ".cxx", ".hxx", ".ipp")
SCOPE_WORDS = re.compile(r"\b(namespace|class|struct|union|enum|extern)\b")
ACCESS = re.compile(r"\b(public|private|protected)\s*:(?!:)")


def strip(text):
    """Blanks comments, literals and preprocessor lines; keeps every newline."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":  # a directive, with its continuation lines
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        at_line_start = False
        if c == "\n":
            out.append(c)
            at_line_start = True
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
            i = end
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            open_paren = text.find("(", i + 2)
            delimiter = text[i + 2:open_paren]
            end = text.find(")" + delimiter + '"', open_paren)
            end = n if end < 0 else end + len(delimiter) + 2
            out.append(" " + "".join(ch if ch == "\n" else " " for ch in text[i + 1:end]))
            i = end
        elif c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum())):
            # A string or character literal (a ' between two alphanumerics is a digit separator).
            quote = c
            j = i + 1
            while j < n and text[j] != quote and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(quote + " " * max(0, j - i - 2) + (quote if j - i >= 2 else ""))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


class ParseError(Exception):
    pass


def closing(text, start, opener, closer):
    """Index of the `closer` that balances the `opener` at `start`, or -1 when none does."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == opener:
            depth += 1
        elif text[k] == closer:
            depth -= 1
            if depth == 0:
                return k
    return -1


def matching(code, start):
    """Index of the brace closing the one at `start`."""
    k = closing(code, start, "{", "}")
    if k < 0:
        raise ParseError("unbalanced brace at offset %d" % start)
    return k


def without_template_prefix(head):
    """The head without leading `template <...>` clauses."""
    head = head.strip()
    while head.startswith("template"):
        k = head.find("<")
        j = closing(head, k, "<", ">") if k >= 0 else -1
        if j < 0:
            break
        head = head[j + 1:].strip()
    return head


def has_parameter_list(head):
    return "(" in head and head.count("(") == head.count(")")


def in_initializer_list(head):
    """Whether `head`, a function head so far, ends inside a constructor's initializer list
    right after a member's name (`X(...) : a_(1), b_`): the next brace initialises b_."""
    close = closing(head, head.find("("), "(", ")")
    if close < 0 or not re.match(r"\s*(noexcept\s*)?:(?!:)", head[close + 1:]):
        return False
    return re.search(r"[\w>]\s*$", head) is not None


def function_name(head):
    """The (qualified) name before the parameter list: `f`, `Type<A, B>::operator()`, `~Type`."""
    head = without_template_prefix(head)
    k = head.find("operator")
    if k >= 0 and re.match(r"operator\s*\(\s*\)", head[k:]):
        paren = head.find("(", head.find(")", k) + 1)
    else:
        paren = head.find("(")
    text = head[:paren].rstrip()
    j, depth = len(text), 0
    while j > 0:  # back over identifiers, ::, ~, operator symbols and balanced <...>
        ch = text[j - 1]
        if ch == ">":
            depth += 1
        elif ch == "<" and depth > 0:
            depth -= 1
        elif depth == 0 and not (ch.isalnum() or ch in "_:~()=[]+-*/!<&|^%"):
            break
        j -= 1
    return " ".join(text[j:].split()) or "(anonymous)"


def functions(code):
    """Yields (name, first line, last line) of every function body, lines counted from 1."""
    line_of = []
    line = 1
    for ch in code:
        line_of.append(line)
        if ch == "\n":
            line += 1

    def scan(begin, end):
        head_start = begin
        k = begin
        while k < end:
            c = code[k]
            if c in ";}":
                head_start = k + 1
            elif c == ":":
                access = ACCESS.search(code, head_start, k + 1)
                if access and access.end() == k + 1:
                    head_start = k + 1
            elif c == "{":
                head = code[head_start:k]
                bare = without_template_prefix(head)
                close = matching(code, k)
                if "(" in bare and not has_parameter_list(bare):
                    k = close + 1  # a default argument `= {}` inside the parameter list
                    continue
                if has_parameter_list(bare) and in_initializer_list(bare):
                    k = close + 1  # a member initializer `x_{...}` of a constructor
                    continue
                if SCOPE_WORDS.search(bare.split("(")[0]):
                    yield from scan(k + 1, close)
                elif has_parameter_list(bare):
                    yield function_name(head), line_of[k], line_of[close]
                k = close + 1
                head_start = k
                continue
            k += 1

    yield from scan(0, len(code))


def source_files(paths):
    for path in paths:
        if os.path.isdir(path):
            for root, _, names in os.walk(path):
                for name in sorted(names):
                    if name.endswith(EXTENSIONS):
                        yield os.path.join(root, name)
        else:
            yield path


def self_test(paths):
    """Every function found must open on a line marked `expect N` with N its length, and every
    marked line must be found."""
    failures = 0
    for path in sorted(source_files(paths)):
        with open(path, encoding="utf-8") as handle:
            raw = handle.read()
        lines = raw.split("\n")
        expected = {}
        for number, text in enumerate(lines, start=1):
            mark = re.search(r"//.*\bexpect (\d+)", text)
            if mark:
                expected[number] = int(mark.group(1))
        found = {}
        for name, first, last in functions(strip(raw)):
            found[first] = (name, last - first + 1)
        for line in sorted(set(expected) | set(found)):
            want = expected.get(line)
            got = found.get(line)
            if got is None:
                print("%s:%d: a function of %d lines was expected here, none found" % (path, line, want))
            elif want is None:
                print("%s:%d: found %s (%d lines) where none was expected" % (path, line, got[0], got[1]))
            elif want != got[1]:
                print("%s:%d: %s has %d lines; expected %d" % (path, line, got[0], got[1], want))
            else:
                print("%s:%d: %s, %d lines: ok" % (path, line, got[0], got[1]))
                continue
            failures += 1
    print("self-test: %d failures" % failures)
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--max-lines", type=int, default=90)
    parser.add_argument("--verbose", action="store_true", help="list every function found")
    parser.add_argument("--self-test", action="store_true",
                        help="check that the functions found in PATHs are those marked `expect N`")
    options = parser.parse_args()
    if options.self_test:
        return self_test(options.paths)
    too_long, unparsed, count = [], [], 0
    for path in sorted(source_files(options.paths)):
        with open(path, encoding="utf-8") as handle:
            code = strip(handle.read())
        try:
            found = list(functions(code))
        except ParseError as error:
            unparsed.append("%s: %s" % (path, error))
            continue
        for name, first, last in found:
            count += 1
            length = last - first + 1
            if options.verbose:
                print("%s:%d: %s, %d lines" % (path, first, name, length))
            if length > options.max_lines:
                too_long.append((length, path, first, name))
    for message in unparsed:
        print("cannot parse " + message)
    for length, path, first, name in sorted(too_long, reverse=True):
        print("%s:%d: %s is %d lines long; expected at most %d" % (path, first, name, length, options.max_lines))
    print("%d functions checked, %d longer than %d lines" % (count, len(too_long), options.max_lines))
    return 2 if unparsed else (1 if too_long else 0)


if __name__ == "__main__":
    sys.exit(main())
