//! The codec against terms the BEAM wrote (`:erlang.term_to_binary/1`, OTP 25) and hostile
//! bytes.

use super::*;

// %{id: 5, op: "check", key: %{exchange: "binance", credential: nil, axis: "ip"},
//   limit: %{capacity: 10, refill_per_sec: 1.5}, cost: 1, owner: "<0.1.0>", max_wait_ms: 70000}
const CHECK: &[u8] = include_bytes!("../../../tests/terms/check.etf");

// [0, 255, 256, -1, 2147483647, -2147483648, 2147483648, -9223372036854775808,
//  18446744073709551615, 18446744073709551616, 1.0e13, -0.5, true, false, nil, :other, "é",
//  [], ~c"abc"]
const SCALARS: &[u8] = &[
    131, 108, 0, 0, 0, 19, 97, 0, 97, 255, 98, 0, 0, 1, 0, 98, 255, 255, 255, 255, 98, 127, 255,
    255, 255, 98, 128, 0, 0, 0, 110, 4, 0, 0, 0, 0, 128, 110, 8, 1, 0, 0, 0, 0, 0, 0, 0, 128, 110,
    8, 0, 255, 255, 255, 255, 255, 255, 255, 255, 110, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 70, 66,
    162, 48, 156, 229, 64, 0, 0, 70, 191, 224, 0, 0, 0, 0, 0, 0, 100, 0, 4, 116, 114, 117, 101,
    100, 0, 5, 102, 97, 108, 115, 101, 100, 0, 3, 110, 105, 108, 100, 0, 5, 111, 116, 104, 101,
    114, 109, 0, 0, 0, 2, 195, 169, 106, 107, 0, 3, 97, 98, 99, 106,
];

// [{1, 2}, %{1 => 2}, [1 | 2], self(), make_ref(), &Enum.map/2, fn -> 1 end, <<1::3>>, :"é"]
const TERMS: &[u8] = &[
    131, 108, 0, 0, 0, 9, 104, 2, 97, 1, 97, 2, 116, 0, 0, 0, 1, 97, 1, 97, 2, 108, 0, 0, 0, 1, 97,
    1, 97, 2, 88, 100, 0, 13, 110, 111, 110, 111, 100, 101, 64, 110, 111, 104, 111, 115, 116, 0, 0,
    0, 96, 0, 0, 0, 0, 0, 0, 0, 0, 90, 0, 3, 100, 0, 13, 110, 111, 110, 111, 100, 101, 64, 110,
    111, 104, 111, 115, 116, 0, 0, 0, 0, 0, 1, 90, 6, 113, 140, 0, 2, 5, 167, 77, 227, 113, 100, 0,
    11, 69, 108, 105, 120, 105, 114, 46, 69, 110, 117, 109, 100, 0, 3, 109, 97, 112, 97, 2, 112, 0,
    0, 0, 85, 0, 202, 237, 96, 189, 124, 70, 238, 40, 128, 173, 29, 233, 181, 118, 140, 169, 0, 0,
    0, 1, 0, 0, 0, 0, 100, 0, 17, 101, 108, 105, 120, 105, 114, 95, 99, 111, 109, 112, 105, 108,
    101, 114, 95, 48, 97, 1, 98, 6, 87, 107, 5, 88, 100, 0, 13, 110, 111, 110, 111, 100, 101, 64,
    110, 111, 104, 111, 115, 116, 0, 0, 0, 96, 0, 0, 0, 0, 0, 0, 0, 0, 77, 0, 0, 0, 1, 3, 32, 100,
    0, 1, 233, 106,
];

// term_to_binary(%{op: "hello"}, minor_version: 2): UTF-8 atoms.
const UTF8_HELLO: &[u8] = &[
    131, 116, 0, 0, 0, 1, 119, 2, 111, 112, 109, 0, 0, 0, 5, 104, 101, 108, 108, 111,
];

fn error(frame: &[u8]) -> Unreadable {
    decode(frame).expect_err("a malformed term")
}

#[test]
fn reads_a_request_the_beam_wrote() {
    assert_eq!(
        decode(CHECK).unwrap(),
        json!({"id": 5, "op": "check", "cost": 1, "owner": "<0.1.0>", "max_wait_ms": 70000,
               "key": {"exchange": "binance", "credential": null, "axis": "ip"},
               "limit": {"capacity": 10, "refill_per_sec": 1.5}})
    );
    assert_eq!(decode(UTF8_HELLO).unwrap(), json!({"op": "hello"}));
}

#[test]
fn reads_numbers_of_any_size_and_names_atoms_without_making_them() {
    let values = decode(SCALARS).unwrap();
    let Value::Array(values) = values else {
        panic!("a list");
    };
    let numbers: Vec<String> = values[..12].iter().map(Value::to_string).collect();
    assert_eq!(
        numbers,
        [
            "0",
            "255",
            "256",
            "-1",
            "2147483647",
            "-2147483648",
            "2147483648",
            "-9223372036854775808",
            "18446744073709551615",
            r#"{"$term":"big_integer"}"#,
            "10000000000000.0",
            "-0.5"
        ]
    );
    assert_eq!(
        Value::Array(values[12..].to_vec()),
        json!([true, false, null, {"$term": "atom"}, "é", [], [97, 98, 99]])
    );
}

#[test]
fn latin1_atom_keys_are_read_as_their_utf8_names() {
    // #{op => 1, 'café' => 2} with both keys as SMALL_ATOM_EXT, as OTP 25 writes them.
    let mut map = vec![VERSION, MAP, 0, 0, 0, 2];
    map.extend_from_slice(&[SMALL_ATOM, 2, b'o', b'p', SMALL_INTEGER, 1]);
    map.extend_from_slice(&[SMALL_ATOM, 4, b'c', b'a', b'f', 0xE9, SMALL_INTEGER, 2]);
    assert_eq!(decode(&map).unwrap(), json!({"op": 1, "café": 2}));
}

#[test]
fn reads_terms_json_cannot_hold_as_their_shape() {
    assert_eq!(
        decode(TERMS).unwrap(),
        json!([
            {"$term": "tuple", "arity": 2},
            {"$term": "map", "size": 1},
            {"$term": "improper_list"},
            {"$term": "pid"},
            {"$term": "reference"},
            {"$term": "function"},
            {"$term": "function"},
            {"$term": "bitstring"},
            {"$term": "atom"},
        ])
    );
}

#[test]
fn long_lists_and_large_maps_are_read_as_their_shape() {
    let mut list = vec![VERSION, LIST];
    list.extend_from_slice(&(MAX_CHECKS as u32 + 1).to_be_bytes());
    list.extend(std::iter::repeat_n([SMALL_INTEGER, 1], MAX_CHECKS + 1).flatten());
    list.push(NIL);
    assert_eq!(decode(&list).unwrap(), json!({"$term": "list"}));

    let mut string = vec![VERSION, STRING];
    string.extend_from_slice(&(MAX_CHECKS as u16 + 1).to_be_bytes());
    string.extend(std::iter::repeat_n(b'a', MAX_CHECKS + 1));
    assert_eq!(decode(&string).unwrap(), json!({"$term": "list"}));

    let mut map = vec![VERSION, MAP];
    map.extend_from_slice(&(MAX_MAP_KEYS as u32 + 1).to_be_bytes());
    for i in 0..=MAX_MAP_KEYS {
        write_binary(&mut map, format!("k{i}").as_bytes());
        map.extend_from_slice(&[SMALL_INTEGER, 1]);
    }
    assert_eq!(
        decode(&map).unwrap(),
        json!({"$term": "map", "size": MAX_MAP_KEYS + 1})
    );
}

#[test]
fn writes_what_it_reads() {
    let value = json!({"ok": true, "error": null, "n": [0, 255, 256, -1, 2147483648_u64,
                       -9223372036854775808_i64, 18446744073709551615_u64, 1.5, -0.0],
                       "s": "é", "empty": [], "nested": {"a": {"b": "c"}}});
    let Value::Object(fields) = &value else {
        unreachable!()
    };
    let mut out = Vec::new();
    encode_map(&mut out, 0, |_| {}, fields);
    assert_eq!(decode(&out).unwrap(), value);
}

#[test]
fn writes_integers_as_the_beam_does() {
    // term_to_binary(255), (256), (-1), (2147483648), (-9223372036854775808), without 131.
    for (n, beam) in [
        (255, &[97, 255][..]),
        (256, &[98, 0, 0, 1, 0]),
        (-1, &[98, 255, 255, 255, 255]),
        (2147483648, &[110, 4, 0, 0, 0, 0, 128]),
        (-9223372036854775808, &[110, 8, 1, 0, 0, 0, 0, 0, 0, 0, 128]),
    ] {
        let mut out = Vec::new();
        write_integer(&mut out, n);
        assert_eq!(out, beam, "{n}");
    }
}

#[test]
fn the_id_is_kept_when_a_later_field_is_malformed() {
    // CHECK with its `key` map's arity raised: the bytes run out after `id` was read.
    let mut frame = CHECK.to_vec();
    let key_arity = 29;
    assert_eq!(&frame[key_arity - 1..key_arity + 4], &[116, 0, 0, 0, 3]);
    frame[key_arity + 3] = 200;
    let unreadable = error(&frame);
    assert_eq!(unreadable.id, Some(json!(5)));
    assert!(unreadable.message.starts_with("malformed external term ("));
}

#[test]
fn refuses_malformed_frames_with_a_reason() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "ends in the middle"),
        (vec![130, NIL], "version byte"),
        (
            vec![VERSION, COMPRESSED, 0, 0, 0, 9, 120, 156],
            "compressed",
        ),
        (vec![VERSION, NIL, NIL], "1 bytes after the term"),
        (vec![VERSION, 0xff], "unknown tag 255"),
        (vec![VERSION, b'D'], "unknown tag 68"),
        (vec![VERSION, b'R', 0], "unknown tag 82"),
        (vec![VERSION, FLOAT], "old float"),
        (
            [&[VERSION, NEW_FLOAT][..], &f64::NAN.to_be_bytes()].concat(),
            "not finite",
        ),
        (
            [&[VERSION, NEW_FLOAT][..], &f64::INFINITY.to_be_bytes()].concat(),
            "not finite",
        ),
        (vec![VERSION, BINARY, 0, 0, 0, 2, 0xff, 0xfe], "not UTF-8"),
        (vec![VERSION, ATOM_UTF8, 0, 1, 0xff], "not UTF-8"),
        (vec![VERSION, BINARY, 255, 255, 255, 255], "beyond"),
        (
            vec![VERSION, LIST, 255, 255, 255, 255, NIL],
            "count of 4294967295",
        ),
        (
            vec![VERSION, MAP, 255, 255, 255, 255],
            "count of 4294967295",
        ),
        (
            vec![VERSION, LARGE_TUPLE, 255, 255, 255, 255],
            "count of 4294967295",
        ),
        (vec![VERSION, LARGE_BIG, 255, 255, 255, 255, 0], "beyond"),
        (vec![VERSION, SMALL_BIG, 1, 2, 1], "sign byte"),
        (vec![VERSION, BIT_BINARY, 0, 0, 0, 1, 0, 1], "bad tail"),
        (vec![VERSION, NEW_FUN, 0, 0, 0, 2], "bad size"),
        (vec![VERSION, NEW_PID, SMALL_INTEGER, 1], "node name"),
    ];
    for (frame, reason) in cases {
        let unreadable = error(&frame);
        assert!(
            unreadable.message.contains(reason),
            "{frame:?}: {}",
            unreadable.message
        );
        assert!(unreadable.message.len() < 200);
    }
}

#[test]
fn deep_nesting_is_refused_without_recursing_through_it() {
    for tag in [[SMALL_TUPLE, 1], [LIST, 0], [MAP, 0]] {
        let mut frame = vec![VERSION];
        for _ in 0..100_000 {
            match tag[0] {
                LIST => frame.extend_from_slice(&[LIST, 0, 0, 0, 1]),
                MAP => frame.extend_from_slice(&[MAP, 0, 0, 0, 1, NIL]),
                _ => frame.extend_from_slice(&tag),
            }
        }
        let unreadable = error(&frame);
        assert!(
            unreadable.message.contains("nesting deeper than 127"),
            "{}",
            unreadable.message
        );
    }
    // At the limit, it is read; a level more is refused, as JSON's arrays (a tuple is read
    // as an object, `[]` as an array, an integer as a number, even past 64 bits).
    let big = [SMALL_BIG, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 64];
    for (tuples, innermost, read) in [
        (MAX_DEPTH - 1, NIL, true),
        (MAX_DEPTH, SMALL_INTEGER, true),
        (MAX_DEPTH, SMALL_BIG, true),
        (MAX_DEPTH, NIL, false),
        (MAX_DEPTH + 1, SMALL_INTEGER, false),
    ] {
        let mut frame = vec![VERSION];
        frame.extend(std::iter::repeat_n([SMALL_TUPLE, 1], tuples).flatten());
        let (term, inner): (&[u8], &str) = match innermost {
            NIL => (&[NIL], "[]"),
            SMALL_BIG => (&big, "1180591620717411303424"),
            _ => (&[SMALL_INTEGER, 7], "7"),
        };
        frame.extend_from_slice(term);
        let decoded = decode(&frame);
        assert_eq!(decoded.is_ok(), read, "{tuples} tuples, then {innermost}");
        let json = format!("{}{inner}{}", "[".repeat(tuples), "]".repeat(tuples));
        let parsed = serde_json::from_str::<serde_json::Value>(&json);
        assert_eq!(parsed.is_ok(), read, "{json}");
    }
}

#[test]
fn every_prefix_and_every_mutation_is_answered_not_panicked_on() {
    for frame in [CHECK, SCALARS, TERMS, UTF8_HELLO] {
        for end in 0..frame.len() {
            assert!(decode(&frame[..end]).is_err(), "a prefix of {end} bytes");
        }
    }
    // xorshift64*: reproducible mutations without a dependency.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    for _ in 0..20_000 {
        let base = [CHECK, SCALARS, TERMS][(next() % 3) as usize];
        let mut frame = base.to_vec();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % frame.len();
            frame[at] = next() as u8;
        }
        let _ = decode(&frame);
    }
}
