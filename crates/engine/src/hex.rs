//! Hex text for ids and keys in JSON files (pool.json, the volume table): plain
//! helpers and serde adapters for fixed-size byte arrays.

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

macro_rules! hex_array {
    ($m:ident, $n:expr) => {
        pub mod $m {
            use serde::{Deserialize, Deserializer, Serializer};
            pub fn serialize<S: Serializer>(v: &[u8; $n], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&super::to_hex(v))
            }
            pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; $n], D::Error> {
                let s = String::deserialize(d)?;
                let v = super::from_hex(&s).ok_or_else(|| serde::de::Error::custom("bad hex"))?;
                v.try_into()
                    .map_err(|_| serde::de::Error::custom("wrong length"))
            }
        }
    };
}
hex_array!(hex12, 12);
hex_array!(hex16, 16);
hex_array!(hex32, 32);
