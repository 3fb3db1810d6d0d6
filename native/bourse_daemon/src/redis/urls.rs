//! Passwords in Redis URLs, found in the URLs' text where the client reads them: whether a
//! URL holds one, and the URL as errors show it.

use std::ops::Range;

/// Whether a Redis URL holds `user:password@` (or `:password@`), or a query field `pass`
/// (where a `unix://` URL holds its password) or `password`.
pub fn has_password(url: &str) -> bool {
    !passwords(&as_parsed(url)).is_empty()
}

/// A Redis URL as errors show it: each password (not empty) replaced by `***`.
pub fn without_password(url: &str) -> String {
    let url = as_parsed(url);
    let mut shown = String::with_capacity(url.len());
    let mut from = 0;
    for password in passwords(&url).into_iter().filter(|p| !p.is_empty()) {
        shown.push_str(&url[from..password.start]);
        shown.push_str("***");
        from = password.end;
    }
    shown.push_str(&url[from..]);
    shown
}

/// `url` as a URL parser reads it: without the spaces and control characters at its ends,
/// and without tabs and newlines anywhere.
fn as_parsed(url: &str) -> String {
    url.trim_matches(|c: char| c <= ' ')
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect()
}

/// Where `url`'s passwords are, in order: the userinfo's after its first `:` (the
/// authority follows the first `://` before any `?` or `#`), and the value of each query
/// field (from the first `?`, fields end at `&` or `#`) whose name, form-decoded as the
/// client decodes it (`%70ass` is `pass`), is `pass` or `password` in any letter case.
fn passwords(url: &str) -> Vec<Range<usize>> {
    let head = url.split(['?', '#']).next().unwrap_or("");
    let userinfo = head.split_once("://").and_then(|(scheme, rest)| {
        let authority = rest.split('/').next().unwrap_or("");
        let (userinfo, _) = authority.rsplit_once('@')?;
        let start = scheme.len() + "://".len();
        Some(start + userinfo.find(':')? + 1..start + userinfo.len())
    });
    let mut passwords: Vec<Range<usize>> = userinfo.into_iter().collect();
    if let Some(query) = url.find('?') {
        let mut start = query + 1;
        for field in url[start..].split(['&', '#']) {
            let end = start + field.len();
            let is_password =
                form_urlencoded::parse(field.as_bytes())
                    .next()
                    .is_some_and(|(name, _)| {
                        name.eq_ignore_ascii_case("pass") || name.eq_ignore_ascii_case("password")
                    });
            if is_password {
                passwords.push(field.find('=').map_or(end, |at| start + at + 1)..end);
            }
            start = end + 1;
        }
    }
    passwords
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_without_their_passwords() {
        for (url, shown) in [
            ("redis://user:hunter2@h:1/2", "redis://user:***@h:1/2"),
            ("redis://:hunter2@h:1", "redis://:***@h:1"),
            ("redis://a@b:hun@ter2@h:1", "redis://a@b:***@h:1"),
            ("redis://user@h:1/?db=1", "redis://user@h:1/?db=1"),
            (
                "unix:///tmp/r.sock?db=1&%70ass=hunter2&db=x",
                "unix:///tmp/r.sock?db=1&%70ass=***&db=x",
            ),
            (
                "unix:///tmp/r.sock?p%61ssword=hun=ter2#pass=hunter2",
                "unix:///tmp/r.sock?p%61ssword=***#pass=***",
            ),
            (
                "unix:/tmp/r.sock?pass=hunter2&pass",
                "unix:/tmp/r.sock?pass=***&pass",
            ),
            (
                "unix:///tmp/r.sock?pa\tss=hunter2\n",
                "unix:///tmp/r.sock?pass=***",
            ),
            (
                "unix:///tmp/r.sock?PASS=hunter2&Password=hunter2",
                "unix:///tmp/r.sock?PASS=***&Password=***",
            ),
            // A `://` in the query starts no authority.
            ("unix:/r?x=a://:hunter2@h", "unix:/r?x=a://:hunter2@h"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(without_password(url), shown, "{url:?}");
            assert_eq!(has_password(url), url != shown, "{url:?}");
        }
    }
}
